use super::mutate::{covers, rdma_resources};
use super::*;
use serde_json::json;

fn cfg() -> MutationConfig {
    let config =
        Config::parse("lustre:\n  mounts: [/lustre/scratch]\n").expect("valid requirements");
    MutationConfig::new(&config, "lustre:\n  mounts: [/lustre/scratch]\n", "img:1")
}

#[test]
fn covers_is_path_aware() {
    assert!(covers("/lustre", "/lustre/scratch"));
    assert!(covers("/lustre/scratch/", "/lustre/scratch"));
    assert!(!covers("/lus", "/lustre/scratch"));
    assert!(covers("/", "/lustre"));
}

#[test]
fn rdma_resources_take_the_largest_and_pair_limits() {
    let c = cfg();
    let containers = vec![
        json!({"resources": {"limits": {"rdma/ib": "2", "nvidia.com/gpu": "8"}}}),
        json!({"resources": {"requests": {"rdma/ib": 4}}}),
    ];
    let (req, lim) = rdma_resources(&containers, &c);
    assert_eq!(req["rdma/ib"], json!(4));
    assert_eq!(lim["rdma/ib"], json!("2"));
    assert!(!req.contains_key("nvidia.com/gpu"));
}

#[test]
fn long_requirements_go_compact_and_too_long_ones_are_refused() {
    let real = "rdma:\n  devices: \"mlx5_*\"\n  min_active_ports: 8\n";
    let yaml = format!(
        "{real}{}",
        "# a long comment line of the operator's\n".repeat(4000)
    );
    assert!(yaml.len() > 150 * 1024);
    let config = Config::parse(&yaml).unwrap();
    let m = MutationConfig::new(&config, &yaml, "img:1");
    m.check().unwrap();
    assert!(m.requirements_yaml.len() <= MAX_REQUIREMENTS_BYTES);
    assert_eq!(Config::parse(&m.requirements_yaml).unwrap(), config);
    let small = MutationConfig::new(&config, real, "img:1");
    assert_eq!(
        small.requirements_yaml, real,
        "a short file goes as written"
    );
    let huge = MutationConfig {
        requirements_yaml: "x".repeat(MAX_REQUIREMENTS_BYTES + 1),
        ..small
    };
    let e = huge.check().unwrap_err().to_string();
    assert!(e.contains("--config") && e.contains("shorten"), "{e}");
}
