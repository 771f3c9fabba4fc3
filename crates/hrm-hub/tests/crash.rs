//! Crash safety of aggregation: the aggregator is aborted at each of its steps (the fault
//! hook makes it fail there, dropping everything it held in memory, as a crash would); then
//! a fresh aggregator over the same storage must lose no update and count none twice.
//! (`crates/hrm-cli/tests/hub.rs` kills a real `hrm hub serve` process as well.)

mod common;

use common::*;
use hrm_hub::aggregator::{STEPS, Step, aggregate};
use hrm_wire::AggregateOutcome;

#[tokio::test]
async fn an_aggregator_aborted_at_any_step_loses_and_doubles_nothing() {
    for step in STEPS {
        let dir = tempfile::tempdir().unwrap();
        let (db, queue, blobs) = local_parts(dir.path()).await;
        let t = serve(db, queue, blobs, policy(&["--outer", "nesterov"]), 4, None).await;
        let (_, before) = current_params(&t.hub).await;
        let mut contributions = Vec::new();
        for i in 0..4 {
            let w = SimWorker::join(&t.url, &format!("c{i}")).await;
            let (batch, receipt, update) = w.contribute(&honest).await;
            contributions.push((receipt.update_id.to_string(), update, batch.num_samples));
        }
        *t.hub.fault.lock().unwrap() = Some(step);
        let crashed = aggregate(&t.hub, 1).await;
        assert!(crashed.is_err(), "{step:?}: the fault must abort the run");
        drop(t);

        // A new process over the same storage: nothing of the old one's memory survives.
        let (db, queue, blobs) = local_parts(dir.path()).await;
        let t = serve(db, queue, blobs, policy(&["--outer", "nesterov"]), 4, None).await;
        let statuses = update_statuses(&t.hub).await;
        let published_before_crash = step == Step::Published;
        for (id, _, _) in &contributions {
            let (status, into) = &statuses[id];
            if published_before_crash {
                assert_eq!(
                    (status.as_str(), into.as_deref()),
                    ("aggregated", Some("v0.1.1")),
                    "{step:?}"
                );
            } else {
                assert_eq!(
                    status, "pending",
                    "{step:?}: an update was lost or consumed"
                );
            }
        }
        let (version, _) = current_params(&t.hub).await;
        assert_eq!(
            version,
            if published_before_crash {
                "v0.1.1"
            } else {
                "v0.1.0"
            },
            "{step:?}"
        );

        let outcome = aggregate(&t.hub, 1).await.unwrap().unwrap();
        if published_before_crash {
            assert_eq!(
                outcome,
                AggregateOutcome::Waiting { pending: 0 },
                "{step:?}"
            );
        } else {
            assert_eq!(
                outcome,
                AggregateOutcome::Success {
                    version: "v0.1.1".into(),
                    num_updates: 4,
                    rejected: 0
                },
                "{step:?}"
            );
        }
        // Exactly one new version, every update in it once, and the parameters are one
        // Nesterov step (from zero momentum: lr * (1 + mu) * mean) from the start.
        let versions = hrm_hub::versions::all_versions(&t.hub).await.unwrap();
        assert_eq!(versions.len(), 2, "{step:?}");
        for (id, _, _) in &contributions {
            assert_eq!(
                update_statuses(&t.hub).await[id],
                ("aggregated".to_string(), Some("v0.1.1".to_string()))
            );
        }
        let mean = weighted_mean(
            &contributions
                .iter()
                .map(|(_, u, n)| (u.clone(), *n))
                .collect::<Vec<_>>(),
        );
        let (_, after) = current_params(&t.hub).await;
        let expected: Vec<f32> = before
            .iter()
            .zip(&mean)
            .map(|(p, d)| p - 0.7 * 1.9 * d)
            .collect();
        assert!(max_abs_diff(&after, &expected) < 1e-6, "{step:?}");
        let validated: i64 = sqlx::query_scalar("SELECT SUM(validated_batches) FROM workers")
            .fetch_one(&t.hub.db.pool)
            .await
            .unwrap();
        assert_eq!(validated, 4, "{step:?}: a batch was counted twice");
        // The aggregator role was freed by the crash.
        let lock = t.hub.db.try_lock_aggregator().await.unwrap();
        assert!(lock.is_some(), "{step:?}");
        lock.unwrap().release().await.unwrap();
    }
}
