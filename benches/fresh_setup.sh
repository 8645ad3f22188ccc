#!/usr/bin/env bash
# The README's setup commands, timed on a fresh Debian bookworm. A new
# machine cannot be had here, so the "fresh machine" is an mmdebstrap chroot of Debian's
# default (required + important) package set on this machine (its kernel, CPUs, network):
# nothing of the project's installed, the project copied in (git ls-files), the host's Rust
# toolchain bind-mounted read-only (the README assumes Rust), an empty CARGO_HOME and target.
#
#   benches/fresh_setup.sh run     ./scripts/setup.sh, then `cargo run --release -- check`
#                                  (the README's first command; exit 1 here: no RDMA)
#   benches/fresh_setup.sh tests   ./scripts/setup.sh, then each .ci/*.sh's apt/pip installs
#                                  and downloads (its --deps part where it has one; the VM
#                                  kernel included), each timed. The two long builds,
#                                  .ci/controlplane.sh (Go) and .ci/image.sh (Dockerfile), are
#                                  timed on the host with cold caches instead (docs/testing.md).
#
# FRESH_BUILD=0 skips the cargo build in `run` (its cold figure is the same build as the
# image's build stage: the same toolchain, Cargo.lock, profile and an empty registry).
# Root; needs mmdebstrap. Work dir: $FRESH_DIR (default /var/tmp/fabricgate-fresh), removed
# first. Prints one "TIME <step> <seconds>" line per step.
set -euo pipefail
what="${1:-run}"
here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
work="${FRESH_DIR:-/var/tmp/fabricgate-fresh}"
root="$work/root"
sysroot="$(rustc --print sysroot)"

if [ -d "$root" ]; then
    for m in $(grep " $root" /proc/mounts | awk '{print $2}' | sort -r); do umount -l "$m" || true; done
    rm -rf "$work"
fi
mkdir -p "$work"
t0=$(date +%s)
mmdebstrap --include=ca-certificates bookworm "$root" >"$work/mmdebstrap.log" 2>&1
echo "TIME mmdebstrap $(( $(date +%s) - t0 ))"
# The machine's own egress CA, as the host has it (not part of the project).
cp /usr/local/share/ca-certificates/*.crt "$root/usr/local/share/ca-certificates/" 2>/dev/null || true
chroot "$root" update-ca-certificates >/dev/null
cp /etc/resolv.conf "$root/etc/resolv.conf"
mkdir -p "$root/src" "$root/opt/rust"
(cd "$here" && git ls-files -z --cached --others --exclude-standard | tar --null -T - -cf -) | tar -C "$root/src" -xf -

cat >"$work/inner.sh" <<EOF
set -euo pipefail
export PATH=/opt/rust/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
export CARGO_HOME=/root/.cargo HOME=/root
cd /src
step() { local n="\$1" t; shift; t=\$(date +%s); "\$@"; echo "TIME \$n \$(( \$(date +%s) - t ))"; }
step setup.sh ./scripts/setup.sh
if [ "$what" = run ] && [ "${FRESH_BUILD:-1}" = 0 ]; then
    :
elif [ "$what" = run ]; then
    rc=0
    t=\$(date +%s)
    cargo run --release -- check >/tmp/check.out 2>/tmp/check.err || rc=\$?
    echo "TIME cargo-run-release-check \$(( \$(date +%s) - t )) (exit \$rc)"
    tail -n 3 /tmp/check.err /tmp/check.out
else
    for s in .ci/*.sh; do
        case "\$s" in
            .ci/controlplane.sh|.ci/image.sh) grep -q -- '--deps' "\$s" && step "\$s --deps" bash "\$s" --deps ;;
            *) step "\$s" bash "\$s" >/tmp/\$(basename "\$s").log 2>&1 ;;
        esac
    done
fi
EOF
unshare --mount --fork bash -c "
    set -e
    mount --make-rprivate /
    mount -t proc proc '$root/proc'
    mount --rbind /sys '$root/sys'
    mount --rbind /dev '$root/dev'
    mount --bind -o ro '$sysroot' '$root/opt/rust'
    cp '$work/inner.sh' '$root/inner.sh'
    chroot '$root' bash /inner.sh
"
echo "TIME total $(( $(date +%s) - t0 ))"
