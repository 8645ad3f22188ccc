//! Real RDMA under qemu (tests/vm/): Soft-RoCE end to end (`softroce_vm`), event-driven
//! detection (`events_vm`), two VMs measuring each other (`peers_vm`) and
//! the gang pre-flight between two VMs on the real apiserver (`gang_vm`), and RDMA resource
//! tracking parsed from a live dump (`restrack_vm`), what RDMA network namespaces do
//! (`netns_vm`), the agent judging an HCA inside its DRA claim's pod's namespace
//! (`dra_netns_vm`), and `fabricgate check`'s pods section telling an RDMA pod from one on
//! sockets between two VMs (`transport_vm`). Each module boots
//! its VM(s) once for all its tests (twice when the emulated machine itself failed:
//! `emulation`).

mod common;

// One VM boot at a time (`common::vm_slot`): the three suites were three processes that
// cargo ran one after another, and their timing assertions assume the CPUs are not shared
// with another emulated machine.
#[path = "vm/dra_netns_vm.rs"]
mod dra_netns_vm;
#[path = "vm/emulation.rs"]
mod emulation;
#[path = "vm/events_vm.rs"]
mod events_vm;
#[path = "vm/gang_vm.rs"]
mod gang_vm;
#[path = "vm/netns_vm.rs"]
mod netns_vm;
#[path = "vm/peers_vm.rs"]
mod peers_vm;
#[path = "vm/restrack_vm.rs"]
mod restrack_vm;
#[path = "vm/softroce_vm.rs"]
mod softroce_vm;
#[path = "vm/transport_vm.rs"]
mod transport_vm;
