//! `fabricgate check` must never panic on what the kernel (or a broken driver) puts in sysfs.
//! Starting from the real-layout fixture, attribute files are overwritten with hostile content
//! (garbage bytes, non-UTF-8, empty, huge or negative numbers, NUL padding, enormous files) and
//! removed, round after round; every round is probed, judged and rendered.

use crate::common;
use fabricgate::agent::check;
use fabricgate::config::Config;
use fabricgate_probes::rdma::VerbsMode;
use fabricgate_probes::{ProbeConfig, Prober, Roots};
use std::fs;
use std::path::{Path, PathBuf};

fn files_under(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in fs::read_dir(dir).unwrap() {
        let entry = entry.unwrap();
        let kind = entry.file_type().unwrap();
        if kind.is_dir() {
            files_under(&entry.path(), out);
        } else if kind.is_file() {
            out.push(entry.path());
        }
    }
}

/// xorshift64*: deterministic, so a failure replays with the same seed.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }

    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
}

fn hostile_content(rng: &mut Rng) -> Vec<u8> {
    const SAMPLES: &[&[u8]] = &[
        b"",
        b"\n",
        b"\0\0\0\0",
        b"4: ACTIVE\0\0\0garbage",
        b"-1\n",
        b"18446744073709551616\n",
        b"99999999999999999999999: ACTIVE\n",
        b"255: \n",
        b": ACTIVE\n",
        b"NaN Gb/sec (4X NDR)\n",
        b"inf Gb/sec (4X NDR)\n",
        b"400 Gb/sec (999X NDR)\n",
        b"400 Gb/sec (4X NDR\n",
        b"0x\n",
        b"0xffffffffffffffff\n",
        b"N/A (no PMA)\n",
        b"\xff\xfe\xfd not utf-8\n",
        b"fe80:0000:0000:0000:zzzz\n",
        b"RoCE v3\n",
        b"Unknown GT/s PCIe\n",
        b"-16\n",
        "é 🦀 ünïcode\n".as_bytes(),
    ];
    match rng.below(3) {
        0 => SAMPLES[rng.below(SAMPLES.len())].to_vec(),
        1 => (0..rng.below(64)).map(|_| rng.next() as u8).collect(),
        // Larger than a page: the reader must loop, not truncate or overflow.
        _ => vec![b'9'; 4096 + rng.below(9000)],
    }
}

#[test]
fn hostile_sysfs_content_never_panics() {
    let tmp = tempfile::tempdir().unwrap();
    let fixture = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/ndr-8x400-healthy");
    common::copy_tree(&fixture, tmp.path());
    let mut files = Vec::new();
    files_under(&tmp.path().join("sys/devices"), &mut files);
    assert!(files.len() > 500, "fixture copy has {} files", files.len());

    let config = Config::parse(
        "rdma:\n  min_active_ports: 8\n  min_rate_gbps: 400\n  link_layer: InfiniBand\n",
    )
    .unwrap();
    let mut prober = Prober::new(
        Roots::new(tmp.path().join("sys"), tmp.path().join("proc")),
        ProbeConfig {
            verbs: VerbsMode::Off,
            ..ProbeConfig::default()
        },
    );
    let mut rng = Rng(0x5eed_f00d_cafe_d00d);
    let mut saw_not_ready = false;
    for round in 0..60 {
        for _ in 0..40 {
            let path = &files[rng.below(files.len())];
            if rng.below(10) == 0 {
                let _ = fs::remove_file(path);
            } else {
                fs::write(path, hostile_content(&mut rng)).unwrap();
            }
        }
        let report = prober.probe();
        let verdict = common::evaluate(&report, &config);
        let json = check::to_json(&report, &verdict);
        let table = check::to_table(&report, &verdict);
        assert!(json.is_object(), "round {round}");
        assert!(table.starts_with("fabricgate: node "), "round {round}");
        // Whatever the damage, the verdict stays consistent with its own parts.
        assert_eq!(verdict.ready, verdict.taints.is_empty(), "round {round}");
        assert_eq!(
            verdict.ready,
            verdict.parts().all(|p| p.ready),
            "round {round}"
        );
        saw_not_ready |= !verdict.ready;
    }
    assert!(saw_not_ready, "60 rounds of damage never failed the node");
}
