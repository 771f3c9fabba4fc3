//! Worker trust: the reputation steps, probation, and the norm screen's arithmetic. Together
//! with `docs/hub-api.md` ("Threat model" and "Trust") this is the whole policy.
//!
//! Invariant: reputation falls only on evidence no other worker can produce, so attackers
//! cannot get honest workers banned: a file that fails its checks, a file changed after it was
//! accepted, an update whose norm lies outside the bounds of the hub's own recomputations, or a
//! re-verification that disagrees. Screens that compare an update with the other uploads (the
//! outlier screen, Krum) only send it to re-verification or leave it out.

/// An update that was aggregated.
pub const REPUTATION_AGGREGATED: f64 = 0.01;
/// A recomputation agreed with the worker's update.
pub const REPUTATION_VERIFIED: f64 = 0.05;
/// An upload that failed a check of its own: bad file, changed after acceptance, norm outside
/// the bounds of honest updates.
pub const REPUTATION_INVALID: f64 = -0.1;
/// A recomputation disagreed with the worker's update.
pub const REPUTATION_DISAGREED: f64 = -0.5;
/// Reputation never rises above this.
pub const REPUTATION_MAX: f64 = 2.0;

/// Recomputed norms the norm reference averages over (the newest weighs `1 / NORM_WINDOW`).
pub const NORM_WINDOW: i64 = 20;

/// The chance that an upload is re-verified. A worker in probation (fewer than `probation`
/// agreeing re-verifications in a row) is checked with probability `1 / (1 + agreements)`:
/// always at first, then less as it keeps agreeing (BOINC's adaptive replication); afterwards
/// at the base rate.
pub fn verify_probability(agreements: i64, probation: i64, base: f64) -> f64 {
    if agreements < probation {
        (1.0 / (1 + agreements.max(0)) as f64).max(base)
    } else {
        base
    }
}

/// An update's weight in the aggregate: its samples times `min(1 + agreements, 1 + probation)`,
/// so a worker in probation counts `(1 + agreements) / (1 + probation)` of an established one.
pub fn weight(num_samples: i64, agreements: i64, probation: i64) -> u64 {
    let trust = (1 + agreements.max(0)).min(1 + probation.max(0));
    num_samples.max(0) as u64 * trust as u64
}

/// Whether `norm` lies within a factor `bound` of `reference`, on either side.
pub fn norm_within(norm: f64, reference: f64, bound: f64) -> bool {
    norm.is_finite() && norm >= reference / bound && norm <= reference * bound
}

/// The norm reference after one more recomputed norm: a running geometric mean over the last
/// [`NORM_WINDOW`] samples (plain over the first ones). `None` for a norm that cannot be a
/// sample (zero or not finite).
pub fn next_norm_reference(current: Option<f64>, samples: i64, norm: f64) -> Option<f64> {
    if !(norm.is_finite() && norm > 0.0) {
        return None;
    }
    Some(match current {
        Some(reference) if samples > 0 && reference > 0.0 => {
            let n = (samples + 1).min(NORM_WINDOW) as f64;
            (reference.ln() + (norm.ln() - reference.ln()) / n).exp()
        }
        _ => norm,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn probation_checks_every_first_upload_then_fewer() {
        assert_eq!(verify_probability(0, 3, 0.05), 1.0);
        assert_eq!(verify_probability(1, 3, 0.05), 0.5);
        assert!((verify_probability(2, 3, 0.05) - 1.0 / 3.0).abs() < 1e-12);
        assert_eq!(verify_probability(3, 3, 0.05), 0.05);
        // Without probation, the base rate only.
        assert_eq!(verify_probability(0, 0, 0.05), 0.05);
    }

    #[test]
    fn probation_bounds_the_weight() {
        assert_eq!(weight(512, 0, 3), 512);
        assert_eq!(weight(512, 1, 3), 1024);
        assert_eq!(weight(512, 3, 3), 2048);
        assert_eq!(weight(512, 30, 3), 2048);
        assert_eq!(weight(512, 0, 0), 512);
    }

    #[test]
    fn the_norm_reference_is_a_running_geometric_mean() {
        let mut reference = None;
        for (samples, norm) in [2.0, 8.0].into_iter().enumerate() {
            reference = next_norm_reference(reference, samples as i64, norm);
        }
        assert!((reference.unwrap() - 4.0).abs() < 1e-9);
        assert_eq!(next_norm_reference(reference, 2, 0.0), None);
        assert_eq!(next_norm_reference(reference, 2, f64::INFINITY), None);
        // An old reference moves by a window's share toward a new sample.
        let moved = next_norm_reference(Some(1.0), 100, std::f64::consts::E).unwrap();
        assert!((moved.ln() - 1.0 / NORM_WINDOW as f64).abs() < 1e-12);
    }

    #[test]
    fn the_norm_screen_is_a_factor_on_either_side() {
        assert!(norm_within(1.0, 1.0, 4.0));
        assert!(norm_within(3.9, 1.0, 4.0));
        assert!(!norm_within(4.1, 1.0, 4.0));
        assert!(!norm_within(0.2, 1.0, 4.0));
        assert!(!norm_within(f64::INFINITY, 1.0, 4.0));
    }
}
