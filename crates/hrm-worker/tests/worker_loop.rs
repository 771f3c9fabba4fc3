//! The worker loop against a real hub in the same process (SQLite, the in-process queue and
//! local files; the hub's own test harness), with faults injected: a connection cut by a proxy
//! in the middle of a batch, and stop pressed during training.

#[path = "../../hrm-hub/tests/common/mod.rs"]
mod hub;

use candle_core::Device;
use hrm_hub::verify::Verdict;
use hrm_worker::config::{BatchSize, WorkerConfig};
use hrm_worker::resources::ResourceArgs;
use hrm_worker::{SessionEnd, Settings, Status, View, Worker, WorkerState};
use hub::{TestHub, batch_status, policy, start, update_statuses};
use std::net::SocketAddr;
use std::time::{Duration, Instant};
use tokio::sync::watch;
use uuid::Uuid;

fn settings(url: &str, cache: &std::path::Path, max_batches: u64, compress: bool) -> Settings {
    let mut config = WorkerConfig::first_run(url);
    config.training.batch_size = BatchSize::Rows(2);
    config.training.max_batches_per_session = max_batches;
    config.training.retry_attempts = 2;
    config.training.timeout_seconds = 10;
    config.uploads.compress_gradients = compress;
    Settings {
        config,
        username: Some(format!("w{}", &Uuid::new_v4().simple().to_string()[..8])),
        retry_delay: Duration::from_millis(100),
        resources: ResourceArgs::default(),
        cache_dir: cache.to_path_buf(),
    }
}

fn worker(settings: Settings) -> (Worker, Status) {
    let status = Status::new(&settings.config.server.url);
    let worker = Worker::new(settings, Device::Cpu, status.clone()).unwrap();
    (worker, status)
}

/// Waits for the worker's view to satisfy `ready`; the test fails after a minute.
async fn until(status: &Status, what: &str, ready: impl Fn(&View) -> bool) -> View {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let view = status.snapshot();
        if ready(&view) {
            return view;
        }
        assert!(
            Instant::now() < deadline,
            "timed out waiting for {what}: {view:#?}"
        );
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
}

fn logged(view: &View, needle: &str) -> bool {
    view.log.iter().any(|line| line.message.contains(needle))
}

async fn pending_updates(t: &TestHub) -> usize {
    update_statuses(&t.hub)
        .await
        .values()
        .filter(|(status, _)| status == "pending")
        .count()
}

async fn assigned_batches(t: &TestHub) -> i64 {
    sqlx::query_scalar("SELECT COUNT(*) FROM training_batches WHERE status = 'assigned'")
        .fetch_one(&t.hub.db.pool)
        .await
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_registers_trains_what_the_plan_says_and_stops_at_its_limit() {
    let t = start(policy(&["--verify-fraction", "1"]), 6).await;
    let cache = tempfile::tempdir().unwrap();
    let (mut worker, status) = worker(settings(&t.url, cache.path(), 3, false));
    let (_stop, stopped) = watch::channel(false);

    assert_eq!(
        worker.run_session(stopped.clone()).await,
        SessionEnd::MaxBatches
    );
    let view = status.snapshot();
    assert_eq!(view.state, WorkerState::Idle);
    assert_eq!(view.session.batches, 3);
    assert!(view.session.tokens > 0);
    assert!(!view.running);
    assert_eq!(
        view.model_version, None,
        "the model is unloaded after the session"
    );
    assert!(logged(&view, "registering"), "a new key registers itself");
    assert_eq!(pending_updates(&t).await, 3);
    assert_eq!(assigned_batches(&t).await, 0);

    // The hub recomputes every upload with the plan it handed out: they agree.
    for _ in 0..3 {
        let verdict = hrm_hub::verify::verify_next(&t.hub).await.unwrap().unwrap();
        assert!(
            matches!(verdict, Verdict::Agreed { cosine } if cosine > 0.9999),
            "{verdict:?}"
        );
    }

    // The next session logs in with the same key and loads the checkpoint from the cache.
    assert_eq!(worker.run_session(stopped).await, SessionEnd::MaxBatches);
    let view = status.snapshot();
    assert!(logged(&view, "from the cache"), "{:#?}", view.log);
    let workers: i64 = sqlx::query_scalar("SELECT COUNT(*) FROM workers")
        .fetch_one(&t.hub.db.pool)
        .await
        .unwrap();
    assert_eq!(workers, 1);
    assert_eq!(pending_updates(&t).await, 6);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn compressed_updates_are_smaller_and_the_hub_takes_them() {
    let t = start(policy(&[]), 4).await;
    let cache = tempfile::tempdir().unwrap();
    let (_stop, stopped) = watch::channel(false);
    let mut sizes = Vec::new();
    for compress in [false, true] {
        let (mut worker, status) = worker(settings(&t.url, cache.path(), 1, compress));
        assert_eq!(
            worker.run_session(stopped.clone()).await,
            SessionEnd::MaxBatches
        );
        sizes.push(status.snapshot().session.upload_bytes);
    }
    assert_eq!(pending_updates(&t).await, 2);
    // 10% of the values, each with a 4-byte index: a fifth of the values' bytes; the file
    // headers (two tensors per parameter) weigh more in this tiny model.
    assert!(
        sizes[1] * 3 < sizes[0],
        "dense {} vs top-k {}",
        sizes[0],
        sizes[1]
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stop_finishes_and_uploads_the_batch_in_progress() {
    let t = start(policy(&[]), 20).await;
    let cache = tempfile::tempdir().unwrap();
    let (mut worker, status) = worker(settings(&t.url, cache.path(), 100, false));
    let (stop, stopped) = watch::channel(false);
    let session = tokio::spawn(async move { worker.run_session(stopped).await });

    let training = until(&status, "training", |v| v.state == WorkerState::Training).await;
    let batch = training.batch.expect("a batch in progress").batch_id;
    stop.send_replace(true);
    assert_eq!(session.await.unwrap(), SessionEnd::Stopped);

    let view = status.snapshot();
    assert_eq!(view.state, WorkerState::Idle);
    assert_eq!(view.model_version, None);
    assert_eq!(batch_status(&t.hub, batch).await, "completed");
    assert_eq!(assigned_batches(&t).await, 0, "no lease is left behind");
    assert_eq!(pending_updates(&t).await as u64, view.session.batches);
}

/// A TCP proxy in front of the hub whose connections can be cut and restored.
struct Proxy {
    url: String,
    up: watch::Sender<bool>,
}

async fn proxy(target: SocketAddr) -> Proxy {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let (up, is_up) = watch::channel(true);
    tokio::spawn(async move {
        loop {
            let (mut inbound, _) = listener.accept().await.unwrap();
            let mut is_up = is_up.clone();
            if !*is_up.borrow() {
                continue; // dropped: the client sees the connection close
            }
            tokio::spawn(async move {
                let Ok(mut outbound) = tokio::net::TcpStream::connect(target).await else {
                    return;
                };
                tokio::select! {
                    _ = tokio::io::copy_bidirectional(&mut inbound, &mut outbound) => {}
                    _ = is_up.wait_for(|up| !*up) => {}
                }
            });
        }
    });
    Proxy { url, up }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dropped_connection_loses_the_batch_and_work_resumes_with_the_next() {
    let t = start(policy(&[]), 20).await;
    let hub_addr: SocketAddr = t.url.trim_start_matches("http://").parse().unwrap();
    let proxy = proxy(hub_addr).await;
    let cache = tempfile::tempdir().unwrap();
    let (mut worker, status) = worker(settings(&proxy.url, cache.path(), 100, false));
    let (stop, stopped) = watch::channel(false);
    let session = tokio::spawn(async move { worker.run_session(stopped).await });

    let training = until(&status, "training", |v| v.state == WorkerState::Training).await;
    let lost = training.batch.unwrap().batch_id;
    proxy.up.send_replace(false);
    // The upload fails after its retries; the step's error is logged and the state stays.
    let failed = until(&status, "the failed step", |v| logged(v, "retrying in")).await;
    assert!(!failed.connected);
    assert_eq!(failed.session.batches, 0);
    proxy.up.send_replace(true);

    // It reconnects by itself and uploads a later batch.
    until(&status, "an upload after reconnecting", |v| {
        v.session.batches >= 1
    })
    .await;
    stop.send_replace(true);
    assert_eq!(session.await.unwrap(), SessionEnd::Stopped);
    let view = status.snapshot();
    assert_eq!(view.session.lost_batches, 1);
    let connects = view
        .log
        .iter()
        .filter(|l| l.message.contains("connected to"))
        .count();
    assert!(connects >= 2, "it connected again: {:#?}", view.log);
    // The update computed before the cut is gone. The hub hands a worker that asks again its
    // own live lease (docs/hub-api.md), so that batch was leased and trained afresh.
    let leases = view
        .log
        .iter()
        .filter(|l| l.message.contains(&format!("leased batch {lost}")))
        .count();
    assert_eq!(leases, 2, "{:#?}", view.log);
    assert_eq!(batch_status(&t.hub, lost).await, "completed");
    assert_eq!(pending_updates(&t).await as u64, view.session.batches);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cut_off_checkpoint_download_resumes_and_a_corrupt_one_starts_over() {
    use hrm_worker::cache::CheckpointCache;
    let t = start(policy(&[]), 1).await;
    let worker = hub::SimWorker::join(&t.url, "cache").await;
    let info = worker.client.current_model().await.unwrap();
    let whole = worker.client.download(&info.checkpoint_url).await.unwrap();
    let dir = tempfile::tempdir().unwrap();
    let cache = CheckpointCache::new(dir.path()).unwrap();
    let partial = dir.path().join(format!("{}.partial", info.sha256));

    // A third arrived before the cut: the rest is asked for with a Range request.
    std::fs::write(&partial, &whole[..whole.len() / 3]).unwrap();
    let mut first_progress = None;
    let (bytes, cached) = cache
        .fetch(&worker.client, &info, |done, total| {
            first_progress.get_or_insert((done, total));
        })
        .await
        .unwrap();
    assert_eq!(bytes, whole);
    assert!(!cached);
    assert_eq!(
        first_progress,
        Some((whole.len() as u64 / 3, Some(whole.len() as u64))),
        "the download starts where the partial file ends"
    );
    assert!(!partial.exists());
    assert!(cache.path_of(&info.sha256).exists());
    // The second time it comes from the cache.
    assert!(
        cache
            .fetch(&worker.client, &info, |_, _| {})
            .await
            .unwrap()
            .1
    );

    // A partial file that does not belong to this checkpoint fails the hash once, then the
    // download starts over.
    std::fs::remove_file(cache.path_of(&info.sha256)).unwrap();
    std::fs::write(&partial, vec![0u8; whole.len() / 2]).unwrap();
    let err = cache
        .fetch(&worker.client, &info, |_, _| {})
        .await
        .unwrap_err()
        .to_string();
    assert!(err.contains("does not match its hash"), "{err}");
    assert!(!partial.exists());
    let (bytes, _) = cache.fetch(&worker.client, &info, |_, _| {}).await.unwrap();
    assert_eq!(bytes, whole);

    // One longer than the checkpoint gets 416 from the hub and is replaced.
    std::fs::remove_file(cache.path_of(&info.sha256)).unwrap();
    std::fs::write(&partial, vec![0u8; whole.len() + 10]).unwrap();
    let (bytes, _) = cache.fetch(&worker.client, &info, |_, _| {}).await.unwrap();
    assert_eq!(bytes, whole);
}
