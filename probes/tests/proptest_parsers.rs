//! Property tests: the mountinfo parser and the sysfs attribute parsers take any bytes the
//! kernel (or a broken driver, or a hostile fixture) can put there, never panic, and keep
//! what they can.

use fabricgate_probes::rdma::sysfs::{
    CounterText, parse_counter, parse_hex_u32, parse_node_type, parse_pcie_speed, parse_phys_state,
    parse_port_state, parse_rate,
};
use fabricgate_probes::storage::mountinfo::{MountTable, normalize};
use proptest::prelude::*;
use std::os::unix::ffi::OsStrExt;

/// The kernel's escaping of a path in mountinfo (`mangle_path` with " \t\n\\"): every other
/// byte is printed as it is, UTF-8 or not.
fn escape(path: &[u8]) -> Vec<u8> {
    let mut out = Vec::new();
    for &b in path {
        if matches!(b, b' ' | b'\t' | b'\n' | b'\\') {
            out.extend_from_slice(format!("\\{b:03o}").as_bytes());
        } else {
            out.push(b);
        }
    }
    out
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    /// Random bytes: no panic; every non-blank line is an entry or a reported bad line.
    #[test]
    fn mountinfo_parser_takes_any_bytes(bytes in proptest::collection::vec(any::<u8>(), 0..2048)) {
        let t = MountTable::parse(&bytes);
        let lines = bytes
            .split(|&b| b == b'\n')
            .filter(|l| !l.iter().all(u8::is_ascii_whitespace))
            .count();
        prop_assert_eq!(t.len() + t.bad_lines.len(), lines);
        for e in t.entries() {
            let _ = (e.is_read_only(), e.mount_options().count(), e.fstype.len());
        }
    }

    /// Any mount point bytes (non-UTF-8 included) survive escaping and parsing byte for byte,
    /// next to lines of garbage.
    #[test]
    fn mountinfo_paths_round_trip(
        points in proptest::collection::vec(proptest::collection::vec(1u8..=255, 1..40), 1..20),
        garbage in proptest::collection::vec(any::<u8>(), 0..64),
    ) {
        let mut text = Vec::new();
        for (i, p) in points.iter().enumerate() {
            let mut point = b"/".to_vec();
            point.extend_from_slice(p);
            text.extend_from_slice(format!("{} 1 0:{i} / ", 100 + i).as_bytes());
            text.extend_from_slice(&escape(&point));
            text.extend_from_slice(b" rw,relatime shared:1 - lustre 10.0.0.1@o2ib:/fs rw,flock\n");
            // A garbage line between entries is reported, never the table.
            let g: Vec<u8> = garbage.iter().copied().filter(|&b| b != b'\n').collect();
            text.extend_from_slice(&g);
            text.push(b'\n');
        }
        let t = MountTable::parse(&text);
        let got: Vec<Vec<u8>> = t
            .of_type("lustre")
            .map(|e| e.mount_point.as_os_str().as_bytes().to_vec())
            .collect();
        let want: Vec<Vec<u8>> = points
            .iter()
            .map(|p| [b"/".as_slice(), p].concat())
            .collect();
        // Garbage may happen to parse as a mount; the real ones come out in order.
        let real: Vec<&Vec<u8>> = got.iter().filter(|g| want.contains(g)).collect();
        prop_assert_eq!(real.len(), want.len());
        let index = t.index();
        for w in &want {
            let p = std::path::Path::new(std::ffi::OsStr::from_bytes(w));
            // Lookups normalise the query; a point the kernel would print canonically is found.
            if normalize(p).as_os_str().as_bytes() == w.as_slice() {
                prop_assert!(index.find(p).is_some(), "{:?} not found", p);
            }
        }
    }

    /// The attribute parsers accept any text without panicking.
    #[test]
    fn sysfs_parsers_take_any_text(s in "\\PC*") {
        let _ = parse_port_state(&s);
        let _ = parse_phys_state(&s);
        let _ = parse_node_type(&s);
        let _ = parse_hex_u32(&s);
        let _ = parse_pcie_speed(&s);
        let _ = parse_counter(&s);
        if let Some(r) = parse_rate(&s) {
            prop_assert!(r.gbps.is_finite() && r.gbps >= 0.0);
        }
    }

    /// And any bytes, as the reader hands them over after UTF-8 decoding (lossy here).
    #[test]
    fn sysfs_parsers_take_any_bytes(bytes in proptest::collection::vec(any::<u8>(), 0..256)) {
        let s = String::from_utf8_lossy(&bytes);
        let _ = (parse_port_state(&s), parse_phys_state(&s), parse_node_type(&s));
        let _ = (parse_hex_u32(&s), parse_pcie_speed(&s), parse_counter(&s), parse_rate(&s));
    }

    /// What the kernel prints is parsed back exactly.
    #[test]
    fn kernel_formats_round_trip(code in 0u8..=255, value in any::<u64>(), lid in any::<u32>(),
                                 gbps in 1u32..=3200, width in 1u8..=32) {
        let state = parse_port_state(&format!("{code}: ANY\n")).map(|s| s.code());
        prop_assert_eq!(state, Some(code));
        let phys = parse_phys_state(&format!("{code}: Any\n")).map(|s| s.code());
        prop_assert_eq!(phys, Some(code));
        prop_assert_eq!(parse_counter(&format!("{value}\n")), Some(CounterText::Value(value)));
        prop_assert_eq!(parse_hex_u32(&format!("{lid:#x}\n")), Some(lid));
        let r = parse_rate(&format!("{gbps} Gb/sec ({width}X NDR)\n"));
        prop_assert_eq!(r.map(|r| (r.gbps, r.width)), Some((f64::from(gbps), width)));
    }
}
