#!/usr/bin/env bash
# The container images the node tests (tests/node.rs) run, built without a registry:
#
#   image                      OCI archive ($FABRICGATE_IMAGE_DIR, default /opt/fabricgate-image)
#   localhost/fabricgate:dev   fabricgate.oci.tar   the project's Dockerfile, built by buildah
#                                                   with CARGO_PROFILE=test-image (below)
#   localhost/pause:3.10       pause.oci.tar        the kubelet's sandbox image (Kubernetes' pause.c)
#   localhost/debian:bookworm  debian.oci.tar       plain Debian bookworm (minbase) for test pods
#
# Each archive carries its full name (org.opencontainers.image.ref.name), so
#   ctr -n k8s.io images import /opt/fabricgate-image/fabricgate.oci.tar
# names the image localhost/fabricgate:dev. `<archive>.stamp` holds the hash of what went into
# it; `.ci/image.sh --check` exits 0 only when every archive is there and matches the current
# inputs (tests/repo/image.rs runs it).
#
# Base images, under the names the Dockerfile's ARG defaults give (so the Dockerfile is built
# unchanged, with its defaults): `debian:bookworm-slim` is an mmdebstrap minbase rootfs;
# `rust:1-bookworm` is pulled from Docker Hub when it can be, else a stand-in: mmdebstrap
# minbase + gcc/libc6-dev/ca-certificates + this machine's Rust toolchain (`rustc --print
# sysroot`: rustup's, /usr/local/cargo's, whichever is on PATH) laid out as the official image
# does (CARGO_HOME=/usr/local/cargo, RUSTUP_HOME=/usr/local/rustup), plus the extra CA
# certificates of this machine (/usr/local/share/ca-certificates), without which cargo in the
# container cannot reach the crate registry through an intercepting egress proxy.
#
# Cached by hashes of the inputs (FABRICGATE_IMAGE_REBUILD=1 rebuilds the three images from
# buildah's caches, FABRICGATE_IMAGE_REBUILD_BASE=1 also makes the base images again):
#   base images   <- this script's base section, the Debian suite, the host toolchain version
#                    and the CA certificates;
#   fabricgate    <- Dockerfile, .dockerignore, Cargo.toml/Cargo.lock and every file of the
#                    build context except tests/ (the binary does not read tests; only the
#                    names cargo's target discovery sees, tests/*.rs and tests/*/main.rs,
#                    are hashed: a test helper or script is no reason to rebuild), the
#                    Cargo profile, + base stamps;
#   pause         <- pause.c (from the k8s.io/kubernetes module tests/controlplane pins).
# Between runs buildah keeps its layers and the Dockerfile's cache mounts (crate registry,
# target dir) under $FABRICGATE_IMAGE_STATE (default /var/lib/fabricgate-image), so a changed
# source rebuilds incrementally.
#
# The Cargo profile: the Dockerfile builds `release` (fat LTO, one codegen unit: 15-30 min on two
# cores) unless told otherwise; this image is built with `--build-arg CARGO_PROFILE=test-image`
# (Cargo.toml: release without LTO, 16 codegen units, incremental, opt-level 1), the same
# Dockerfile, stages, packages, user and entrypoint, so that a source change does not cost a
# fat-LTO build before the node tests can run. Users build `release`.
#
# Under CI=true any failure (the Dockerfile stops building, say) fails this script and so the
# test setup; outside CI it warns, exits 0 and the tests that need the images skip, saying so.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
out="${FABRICGATE_IMAGE_DIR:-/opt/fabricgate-image}"
state="${FABRICGATE_IMAGE_STATE:-/var/lib/fabricgate-image}"
suite=bookworm
fabricgate_ref=localhost/fabricgate:dev
pause_ref=localhost/pause:3.10
debian_ref=localhost/debian:bookworm
# The names the Dockerfile's ARG defaults resolve to.
build_ref=docker.io/library/rust:1-bookworm
runtime_ref=docker.io/library/debian:bookworm-slim
k8s_version=v1.37.2
cargo_profile=test-image

mode=build
case "${1:-}" in
    --check) mode=check ;;
    --stamps) mode=stamps ;;
    --deps) mode=deps ;;
    "") ;;
    *) echo "usage: $0 [--check|--stamps|--deps]" >&2; exit 2 ;;
esac

in_ci() { [ "${CI:-}" = true ] || [ "${CI:-}" = 1 ]; }
log() { echo "image: $*"; }
die() {
    echo "image: $*" >&2
    if in_ci || [ "$mode" != build ]; then exit 1; fi
    echo "image: not CI: continuing without the images; tests that need them skip" >&2
    exit 0
}
sha() { sha256sum | cut -d' ' -f1; }

# ---------------------------------------------------------------- stamps (what goes in)
toolchain_id() {
    if command -v rustc >/dev/null 2>&1; then
        rustc -Vv 2>/dev/null
        cargo -V 2>/dev/null || true
    else
        echo "no host rustc"
    fi
}
# The base-image section of this script is everything between the two markers below.
base_section() { sed -n '/^# >>> base images/,/^# <<< base images/p' "${BASH_SOURCE[0]}"; }
base_stamp() {
    {
        echo "$suite"
        base_section
        toolchain_id
        cat /usr/local/share/ca-certificates/*.crt 2>/dev/null || true
    } | sha
}
context_files() {
    # The build context minus what .dockerignore leaves out and minus tests/ contents.
    (
        cd "$here"
        if git rev-parse --is-inside-work-tree >/dev/null 2>&1; then
            git ls-files -z --cached --others --exclude-standard
        else
            find . -type f -not -path './.git/*' -not -path './target/*' -printf '%P\0'
        fi
    ) | tr '\0' '\n' | grep -Ev '^(\.git|\.ci|target|docs|deploy|charts)/|(^|/)target/|^tests/vm/cache/|^daemonset\.yaml$|^[^/]*\.md$' \
        | LC_ALL=C sort
}
fabricgate_stamp() {
    local files
    files="$(context_files)"
    {
        base_stamp
        cd "$here"
        echo "cargo profile $cargo_profile"
        cat Dockerfile .dockerignore
        grep -E '^tests/([^/]*\.rs|[^/]*/main\.rs)$' <<<"$files" | sed 's/^/name /' || true
        grep -v '^tests/' <<<"$files" | while IFS= read -r f; do [ -f "$f" ] && printf '%s\n' "$f"; done \
            | tr '\n' '\0' | xargs -0 -r sha256sum
    } | sha
}
pause_c() {
    local dir
    dir="$(go env GOMODCACHE)/k8s.io/kubernetes@$k8s_version"
    [ -f "$dir/build/pause/linux/pause.c" ] \
        || (cd "$here/tests/controlplane" && go mod download "k8s.io/kubernetes@$k8s_version") >/dev/null 2>&1 \
        || return 1
    [ -f "$dir/build/pause/linux/pause.c" ] || return 1
    echo "$dir/build/pause/linux/pause.c"
}
pause_stamp() { { echo "$k8s_version"; cat "$(pause_c)"; } | sha; }

fresh() { # archive stamp
    [ -s "$out/$1" ] && [ "$(cat "$out/$1.stamp" 2>/dev/null)" = "$2" ] && [ -z "${FABRICGATE_IMAGE_REBUILD:-}" ]
}

if [ "$mode" = stamps ]; then
    echo "base $(base_stamp)"
    echo "fabricgate $(fabricgate_stamp)"
    echo "pause $(pause_stamp)"
    exit 0
fi
if [ "$mode" = check ]; then
    bad=0
    for pair in "fabricgate.oci.tar $(fabricgate_stamp)" "debian.oci.tar $(base_stamp)" "pause.oci.tar $(pause_stamp)"; do
        set -- $pair
        if ! fresh "$1" "$2"; then
            if [ -s "$out/$1" ]; then
                echo "image: $out/$1 is stale (built from other inputs): run .ci/image.sh (log: $state/logs/)" >&2
            else
                echo "image: $out/$1 is missing: run .ci/image.sh (log: $state/logs/)" >&2
            fi
            bad=1
        fi
    done
    exit "$bad"
fi

# ---------------------------------------------------------------- build
[ "$(id -u)" -eq 0 ] || die "must run as root (buildah stores images under $state)"
# The packages (--deps: only these) are .ci/node.sh's: buildah, mmdebstrap, runc, uidmap,
# containers-common, gcc + libc6-dev (a static pause), ca-certificates. It runs after this
# script in scripts/setup-tests.sh's order, so run it here (it is idempotent).
install_deps() { bash "$here/.ci/node.sh"; }
if [ "$mode" = deps ]; then
    install_deps
    exit 0
fi
install_deps || die ".ci/node.sh (buildah, mmdebstrap, runc, ...) failed"

mkdir -p "$out" "$state/logs" "$state/tmp" "$state/rootfs"
# One build at a time: two builds (two worktrees on one machine) share buildah's storage, the
# cache mounts' target/ (cargo would wait on its lock, then each rebuild what the other just
# built) and the archives.
exec 9>"$state/lock"
if ! flock -n 9; then
    log "waiting for the other .ci/image.sh run to finish (lock $state/lock)"
    flock 9
fi
# buildah's own configuration, all under $state: storage (layers, images), the cache mounts'
# home (buildah keeps them under TMPDIR), runc, host network for RUN, and limits this machine
# can set (no CAP_SYS_RESOURCE here: the defaults nofile=1048576 fail with EPERM).
cat >"$state/containers.conf" <<EOF
[containers]
netns = "host"
default_ulimits = ["nofile=20000:20000", "nproc=32768:32768"]
[engine]
cgroup_manager = "cgroupfs"
events_logger = "file"
events_logfile_path = "$state/events.log"
runtime = "runc"
[network]
network_backend = "cni"
EOF
# The run root (locks, mount state) belongs to the graph root: a second state directory (a cold
# build measured beside the warm one) gets its own.
runroot=/run/fabricgate-image
if [ "$state" != /var/lib/fabricgate-image ]; then
    runroot="/run/fabricgate-image-$(printf '%s' "$state" | sha | cut -c1-12)"
fi
cat >"$state/storage.conf" <<EOF
[storage]
driver = "overlay"
graphroot = "$state/storage"
runroot = "$runroot"
EOF
cat >"$state/registries.conf" <<EOF
unqualified-search-registries = ["docker.io"]
EOF
export CONTAINERS_CONF="$state/containers.conf"
export CONTAINERS_STORAGE_CONF="$state/storage.conf"
export CONTAINERS_REGISTRIES_CONF="$state/registries.conf"
export TMPDIR="$state/tmp"
bah() { buildah "$@"; }

timed() { # name command...: run, log to $state/logs/name.log, report seconds
    local name="$1" t0 rc=0
    shift
    t0=$(date +%s)
    "$@" >"$state/logs/$name.log" 2>&1 || rc=$?
    if [ "$rc" -ne 0 ]; then
        tail -n 40 "$state/logs/$name.log" >&2
        die "$name failed (rc $rc; log $state/logs/$name.log)"
    fi
    log "$name: $(( $(date +%s) - t0 )) s"
}

# >>> base images (this section's text is part of the base images' stamp)
from_rootfs() { # tar ref cmd: a one-layer image from a rootfs tarball
    local c
    c=$(bah from scratch)
    bah add "$c" "$1" /
    bah config --cmd "$3" --env PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin "$c"
    bah commit --rm "$c" "$2"
}
build_debian() {
    mmdebstrap --variant=minbase --mode=root --format=tar "$suite" "$state/rootfs/debian.tar"
    from_rootfs "$state/rootfs/debian.tar" "$runtime_ref" /bin/bash
    bah tag "$runtime_ref" "$debian_ref"
}
build_rust_standin() {
    local sysroot
    sysroot="$(rustc --print sysroot)"
    [ -x "$sysroot/bin/cargo" ] || { echo "no cargo in $sysroot/bin"; return 1; }
    # The toolchain as the official image lays it out (without its 800 MB of HTML docs).
    mmdebstrap --variant=minbase --mode=root --format=tar \
        --include=ca-certificates,gcc,libc6-dev \
        --customize-hook='mkdir -p "$1/usr/local/rustup/toolchains/host" "$1/usr/local/cargo/bin"' \
        --customize-hook="tar -C '$sysroot' --exclude=./share/doc -cf - . | tar -C \"\$1/usr/local/rustup/toolchains/host\" -xf -" \
        --customize-hook='for b in "$1"/usr/local/rustup/toolchains/host/bin/*; do ln -s "/usr/local/rustup/toolchains/host/bin/${b##*/}" "$1/usr/local/cargo/bin/${b##*/}"; done' \
        --customize-hook='if ls /usr/local/share/ca-certificates/*.crt >/dev/null 2>&1; then cp /usr/local/share/ca-certificates/*.crt "$1/usr/local/share/ca-certificates/"; chroot "$1" update-ca-certificates; fi' \
        "$suite" "$state/rootfs/rust.tar"
    local c
    c=$(bah from scratch)
    bah add "$c" "$state/rootfs/rust.tar" /
    bah config --cmd /bin/bash \
        --env RUSTUP_HOME=/usr/local/rustup --env CARGO_HOME=/usr/local/cargo \
        --env PATH=/usr/local/cargo/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin "$c"
    bah commit --rm "$c" "$build_ref"
    c=$(bah from --pull=never "$build_ref")
    bah run --network=host "$c" -- cargo -V
    bah rm "$c"
}
build_rust() {
    if timeout 120 buildah pull --quiet "$build_ref"; then
        echo "pulled the official $build_ref"
    else
        echo "cannot pull $build_ref: building the stand-in from the host toolchain"
        build_rust_standin
    fi
}
# <<< base images

started=$(date +%s)
bstamp="$(base_stamp)"
if [ "$(cat "$state/base.stamp" 2>/dev/null)" = "$bstamp" ] && [ -z "${FABRICGATE_IMAGE_REBUILD_BASE:-}" ] \
    && bah inspect --type image "$build_ref" >/dev/null 2>&1 \
    && bah inspect --type image "$runtime_ref" >/dev/null 2>&1; then
    log "base images up to date"
else
    command -v rustc >/dev/null 2>&1 || die "no rustc on PATH: the stand-in rust:1-bookworm takes the host's toolchain"
    timed base-debian build_debian
    timed base-rust build_rust
    rm -f "$state/rootfs/"*.tar   # in buildah's storage now
    echo "$bstamp" >"$state/base.stamp"
fi

if fresh debian.oci.tar "$bstamp"; then
    log "debian.oci.tar up to date"
else
    rm -f "$out/debian.oci.tar"
    timed push-debian bah push "$debian_ref" "oci-archive:$out/debian.oci.tar.new:$debian_ref"
    mv "$out/debian.oci.tar.new" "$out/debian.oci.tar"
    echo "$bstamp" >"$out/debian.oci.tar.stamp"
fi

pc="$(pause_c)" || die "pause.c not found in k8s.io/kubernetes@$k8s_version (go mod download in tests/controlplane; needs Go and the module proxy)"
pstamp="$(pause_stamp)"
if fresh pause.oci.tar "$pstamp"; then
    log "pause.oci.tar up to date"
else
    build_pause() {
        local d c
        d="$state/pause"
        rm -rf "$d" && mkdir -p "$d"
        gcc -Os -Wall -Werror -static -DVERSION="$k8s_version" -o "$d/pause" "$pc"
        strip "$d/pause" || true
        c=$(bah from scratch)
        bah copy --chmod 0755 "$c" "$d/pause" /pause
        bah config --entrypoint '["/pause"]' --user 65535:65535 "$c"
        bah commit --rm "$c" "$pause_ref"
        rm -f "$out/pause.oci.tar"
        bah push "$pause_ref" "oci-archive:$out/pause.oci.tar.new:$pause_ref"
        mv "$out/pause.oci.tar.new" "$out/pause.oci.tar"
    }
    timed pause build_pause
    echo "$pstamp" >"$out/pause.oci.tar.stamp"
fi

fstamp="$(fabricgate_stamp)"
if fresh fabricgate.oci.tar "$fstamp"; then
    log "fabricgate.oci.tar up to date ($fabricgate_ref)"
else
    # The Dockerfile unchanged, with its own base-image ARG defaults (rust:1-bookworm,
    # debian:bookworm-slim: the local images above; --pull=never keeps buildah from looking for
    # them on Docker Hub) and the test image's Cargo profile.
    timed fabricgate bah bud --pull=never --layers --network=host \
        --build-arg "CARGO_PROFILE=$cargo_profile" \
        -t "$fabricgate_ref" -f "$here/Dockerfile" "$here"
    # An input that does not change the image (a test file, a comment outside the build) gives
    # the same image ID from the layer cache: the archive already holds it.
    id="$(bah inspect --type image --format '{{.FromImageID}}' "$fabricgate_ref")"
    if [ -s "$out/fabricgate.oci.tar" ] && [ "$(cat "$out/fabricgate.oci.tar.id" 2>/dev/null)" = "$id" ]; then
        log "fabricgate: same image $id as the archive"
    else
        rm -f "$out/fabricgate.oci.tar"
        timed push-fabricgate bah push "$fabricgate_ref" "oci-archive:$out/fabricgate.oci.tar.new:$fabricgate_ref"
        mv "$out/fabricgate.oci.tar.new" "$out/fabricgate.oci.tar"
        echo "$id" >"$out/fabricgate.oci.tar.id"
    fi
    echo "$fstamp" >"$out/fabricgate.oci.tar.stamp"
fi
log "ready in $(( $(date +%s) - started )) s: $out/{fabricgate,pause,debian}.oci.tar"
