//! Parse a 2,000-line mount table (shaped like a busy Kubernetes node's, the table of
//! `cargo bench --bench storage`) N times: the workload whose instructions
//! `benches/callgrind_probe.sh` counts per parse.
//!
//! `cargo run --release --example mountinfo_parse -- 11`

use fabricgate_probes::storage::mountinfo::MountTable;
use std::hint::black_box;

#[path = "../benches/mountinfo_table.rs"]
mod mountinfo_table;

/// The same table as `big_mountinfo(&[])` in benches/storage.rs.
fn table() -> String {
    mountinfo_table::busy_node_mountinfo(2000 - 1)
}

fn main() -> anyhow::Result<()> {
    let n: u32 = std::env::args().nth(1).map_or(Ok(1), |n| n.parse())?;
    let text = table();
    let mut entries = 0;
    for _ in 0..n {
        entries += black_box(MountTable::parse(black_box(&text))).len();
    }
    println!("{entries} entries in {n} parses");
    Ok(())
}
