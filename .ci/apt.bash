# Sourced by the .ci/*.sh test setups (scripts/setup-tests.sh runs .ci/*.sh only, so this file
# is not run on its own).
#
# apt_install PKG...: `apt-get update` and `apt-get install -y --no-install-recommends PKG...`,
# unless every PKG is already installed (dpkg status `ii`). On a warm machine that skips an
# `apt-get update` and an install that changes nothing in each of the setups (3-10 s each);
# on a fresh one, or with one package missing, it is the plain update and install.
#
# One apt at a time: scripts/setup-tests.sh runs the Go builds' lane beside the rest, and two
# apt-gets at once fail on dpkg's lock instead of waiting for it. Every apt-get of the setups
# holds $FABRICGATE_APT_LOCK (scripts/setup.sh takes the same file).
FABRICGATE_APT_LOCK="${FABRICGATE_APT_LOCK:-/var/lock/fabricgate-apt.lock}"
apt_install() {
    local p
    for p in "$@"; do
        if ! dpkg-query -W -f='${db:Status-Abbrev}\n' "$p" 2>/dev/null | grep -q '^ii'; then
            (
                flock 8
                DEBIAN_FRONTEND=noninteractive apt-get update
                DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends "$@"
            ) 8>"$FABRICGATE_APT_LOCK"
            return
        fi
    done
    echo "apt: already installed: $*"
}
