use super::*;

#[test]
fn copies_probed_at_once_come_back_as_their_processes_exit() {
    let now = Instant::now();
    let mut budget = Budget::default();
    for _ in 0..LIVE_PER_UID {
        budget.may_probe(1000, now).unwrap();
    }
    assert_eq!(
        budget.may_probe(1000, now),
        Err(BudgetRefusal::LiveForUid(LIVE_PER_UID, 1000))
    );
    assert_eq!(budget.may_probe(1001, now), Ok(()), "another uid's own");
    budget.released(1000);
    assert_eq!(budget.may_probe(1000, now), Ok(()));
}

#[test]
fn new_copies_are_bounded_over_time_even_as_processes_exit() {
    let t0 = Instant::now();
    let mut budget = Budget::default();
    for _ in 0..PROBES_PER_UID.burst {
        budget.may_probe(1000, t0).unwrap();
        budget.released(1000);
    }
    assert_eq!(
        budget.may_probe(1000, t0),
        Err(BudgetRefusal::RateForUid(1000, PROBES_PER_UID.burst))
    );
    assert_eq!(budget.may_probe(1000, t0 + PROBES_PER_UID.every), Ok(()));
}

#[test]
fn root_counts_to_the_total_only() {
    let now = Instant::now();
    let mut budget = Budget::default();
    for _ in 0..LIVE_ALL {
        budget.may_probe(0, now).unwrap();
    }
    assert_eq!(budget.may_probe(0, now), Err(BudgetRefusal::Live(LIVE_ALL)));
    assert_eq!(
        budget.may_probe(1000, now),
        Err(BudgetRefusal::Live(LIVE_ALL))
    );
    budget.released(0);
    assert_eq!(
        budget.may_probe(1000, now),
        Err(BudgetRefusal::Rate(64)),
        "none new lately"
    );
    assert_eq!(budget.may_probe(1000, now + PROBES_ALL.every), Ok(()));
}

#[test]
fn examinations_are_bounded_per_uid_and_in_all() {
    let t0 = Instant::now();
    let mut budget = Budget::default();
    let per_uid = CHECKS_PER_UID.burst;
    assert!((0..per_uid).all(|_| budget.may_check(1000, t0)));
    assert!(!budget.may_check(1000, t0));
    assert!(budget.may_check(1001, t0), "another uid's own");
    let t1 = t0 + CHECKS_PER_UID.every;
    assert!(budget.may_check(1000, t1));
    // Root's come from the total alone, which ends too, for every uid.
    while budget.may_check(0, t1) {}
    assert!(!budget.may_check(1002, t1));
    assert!(budget.may_check(0, t1 + CHECKS_ALL.every));
}
