//! GPUDirect's part of the verdict, judged from literal reports.

use super::judge::{GpudirectCheck, evaluate_gpudirect};
use crate::config::Config;
use crate::policy::check::{CheckVerdict, Contribution};
use fabricgate_probes::gpudirect::GpudirectReport;
use fabricgate_probes::gpudirect::pci::Relation;

fn config(yaml: &str) -> Config {
    Config::parse(yaml).unwrap()
}

fn part(c: &Contribution) -> CheckVerdict {
    CheckVerdict::of(&GpudirectCheck, c)
}

fn gpu_report(gpus: &[&str], pairs: &[(&str, &str, Relation)]) -> GpudirectReport {
    use fabricgate_probes::gpudirect::{Gpu, Hca, Pair, PeerMemory};
    let mut hcas: Vec<&str> = pairs.iter().map(|p| p.1).collect();
    hcas.sort_unstable();
    hcas.dedup();
    GpudirectReport {
        gpus: gpus
            .iter()
            .map(|a| Gpu {
                address: (*a).into(),
                device: None,
                class: "0x030200".into(),
                numa_node: Some(0),
                path: String::new(),
            })
            .collect(),
        hcas: hcas
            .iter()
            .map(|h| Hca {
                name: (*h).into(),
                address: String::new(),
                numa_node: Some(0),
                path: String::new(),
            })
            .collect(),
        pairs: pairs
            .iter()
            .map(|(g, h, r)| Pair {
                gpu: (*g).into(),
                hca: (*h).into(),
                hca_address: String::new(),
                relation: *r,
                numa: Some(0),
                hca_numa: Some(1),
                bridges: Vec::new(),
            })
            .collect(),
        worst_relation: pairs.iter().map(|p| p.2).max(),
        peermem: PeerMemory {
            method: Some("dma-buf".into()),
            ..PeerMemory::default()
        },
        ..GpudirectReport::default()
    }
}

#[test]
fn rails_label_maps_gpus_to_hca_indices_and_marks_gpus_without_one() {
    let gd = gpu_report(
        &["0000:01:00.0", "0000:02:00.0", "0000:03:00.0"],
        &[
            ("0000:01:00.0", "mlx5_1", Relation::Pix),
            ("0000:03:00.0", "mlx5_0", Relation::Phb),
        ],
    );
    let c = evaluate_gpudirect(&gd, &config(""));
    assert_eq!(c.details["rails"], "1.x.0");
    assert_eq!(c.details["relation"], "PHB");
    assert!(c.labels.contains(&("rails".to_owned(), "1.x.0".to_owned())));
    let v = part(&c);
    assert!(v.part.ready, "not required: warnings only");
    assert_eq!(v.part.warnings[0].code, "GPUHCATooFar");
    let v = part(&evaluate_gpudirect(
        &gd,
        &config("gpudirect:\n  max_relation: PHB\n"),
    ));
    assert!(v.part.warnings.is_empty(), "{:?}", v.part.warnings);
    let v = part(&evaluate_gpudirect(
        &gd,
        &config("gpudirect:\n  required: true\n"),
    ));
    assert!(!v.part.ready);
    assert_eq!(v.part.findings[0].code, "GPUHCATooFar");
    // GPUs without any HCA.
    let gd = gpu_report(&["0000:01:00.0"], &[]);
    let c = evaluate_gpudirect(&gd, &config("gpudirect:\n  required: true\n"));
    assert_eq!(part(&c).part.findings[0].code, "NoHCAForGPUs");
    assert!(c.details["rails"].is_null());
    // 40 GPUs do not fit a label value: no label, a warning.
    let names: Vec<String> = (0..40).map(|i| format!("0000:{i:02x}:00.0")).collect();
    let refs: Vec<&str> = names.iter().map(String::as_str).collect();
    let pairs: Vec<(&str, &str, Relation)> =
        refs.iter().map(|g| (*g, "mlx5_0", Relation::Pix)).collect();
    let c = evaluate_gpudirect(&gpu_report(&refs, &pairs), &config(""));
    assert!(c.details["rails"].is_null());
    assert!(c.labels.iter().all(|(k, _)| k != "rails"));
    let v = part(&c);
    assert!(
        v.part
            .warnings
            .iter()
            .any(|w| w.code == "RailsLabelTooLong")
    );
}
