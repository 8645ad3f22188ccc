//! `common::vm_emulation_fault` on guest kernel logs kept from real runs of the peer pair
//! (tests/vm/fixtures/faults/): what makes `run_vm_once` boot a VM run once more, and what
//! must not. No VM needed.

use crate::common;
use std::path::PathBuf;

fn fixture(name: &str) -> PathBuf {
    common::repo_root()
        .join("tests/vm/fixtures/faults")
        .join(name)
}

/// A copy of the fixture's files laid out as a run's output folder.
fn run_folder(name: &str) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    common::copy_tree(&fixture(name), dir.path());
    dir
}

#[test]
fn a_stalled_emulated_nic_is_a_fault_of_the_machine() {
    let run = run_folder("tx-stall");
    let fault = common::vm_emulation_fault(run.path()).expect("the stall is found");
    assert!(
        fault.contains("a/dmesg.log")
            && fault.contains("eth0: NETDEV WATCHDOG: CPU: 0: transmit queue 0 timed out 5152 ms"),
        "{fault}"
    );
}

#[test]
fn a_guest_panic_in_soft_roce_is_a_fault_of_the_machine() {
    let run = run_folder("rxe-panic");
    let fault = common::vm_emulation_fault(run.path()).expect("the panic is found");
    assert!(
        fault.contains("b/console.log") && fault.contains("RIP: 0010:rxe_skb_tx_dtor"),
        "{fault}"
    );
}

#[test]
fn a_healthy_run_and_an_rxe_warning_alone_are_not() {
    let run = run_folder("healthy");
    assert_eq!(common::vm_emulation_fault(run.path()), None);
    // rxe's warnings (a RIP line in [rdma_rxe] with no panic) go with a stall but are not one.
    let stall = std::fs::read_to_string(fixture("tx-stall/a/dmesg.log")).unwrap();
    let warnings: String = stall
        .lines()
        .filter(|l| !l.contains("NETDEV WATCHDOG"))
        .map(|l| format!("{l}\n"))
        .collect();
    assert!(warnings.contains("RIP: 0010:__rxe_cleanup"), "{warnings}");
    std::fs::write(run.path().join("a/dmesg.log"), warnings).unwrap();
    assert_eq!(common::vm_emulation_fault(run.path()), None);
    // Nothing to read at all is no fault either.
    assert_eq!(
        common::vm_emulation_fault(&run.path().join("missing")),
        None
    );
}
