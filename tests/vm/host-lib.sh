# Sourced by run.sh and run-pair.sh on the host: their command line, the environment of the
# guest job, and the qemu command line of one test VM.
# shellcheck shell=bash

# vm_args TIMEOUT USAGE NEED_OUT "$@": parse `[-t SECONDS] [-o OUTDIR] SCRIPT` into timeout_s
# (TIMEOUT without -t), out (empty without -o) and script; exit 2 with "usage: $0 USAGE" on
# other words or, when NEED_OUT is 1, without -o; or naming SCRIPT when it is not a file.
vm_args() {
    local usage="$2" need_out="$3" opt
    timeout_s="$1"
    out=""
    shift 3
    OPTIND=1
    while getopts "t:o:" opt; do
        case "$opt" in
            t) timeout_s="$OPTARG" ;;
            o) out="$OPTARG" ;;
            *) echo "usage: $0 $usage" >&2; exit 2 ;;
        esac
    done
    shift $((OPTIND - 1))
    [ $# -eq 1 ] && { [ "$need_out" = 0 ] || [ -n "$out" ]; } ||
        { echo "usage: $0 $usage" >&2; exit 2; }
    script="$1"
    [ -f "$script" ] || { echo "$(basename "$0"): no such script: $script" >&2; exit 2; }
}

# vm_kernel: run setup.sh (it builds the kernel tree and initramfs once, cached) and load
# KVER, KROOT, KERNEL and INITRD from the file it names.
vm_kernel() {
    local envfile
    envfile="$("$here/setup.sh")"
    # shellcheck disable=SC1090
    . "$envfile"
}

# vm_guest_env FILE [NAME=VALUE...]: write FILE, the guest job's environment: FG_CWD (this
# directory), FG_KROOT/FG_KVER (the kernel tree), FG_VM_DIR (tests/vm), FG_OUT=/tmp/fg-out and
# the NAME=VALUEs given, then every other FG_* variable of this environment.
vm_guest_env() {
    local file="$1" fixed="FG_CWD FG_KROOT FG_KVER FG_VM_DIR FG_OUT" kv name
    shift
    {
        printf 'export FG_CWD=%q FG_KROOT=%q FG_KVER=%q FG_VM_DIR=%q FG_OUT=/tmp/fg-out' \
            "$PWD" "$KROOT" "$KVER" "$here"
        for kv in "$@"; do
            printf ' %s=%q' "${kv%%=*}" "${kv#*=}"
            fixed="$fixed ${kv%%=*}"
        done
        printf '\n'
        while IFS='=' read -r name _; do
            case " $fixed " in
                *" $name "*) ;;
                *) case "$name" in FG_*) printf 'export %s=%q\n' "$name" "${!name}" ;; esac ;;
            esac
        done < <(env)
    } >"$file"
}

# vm_boot SECONDS CPUS OUTDIR CONSOLE [QEMU ARGS...]: one test VM under pure emulation (KVM
# hangs under nested virtualization on these machines), killed after SECONDS: the kernel and
# initramfs of setup.sh, the host root read-only (9p tag hostroot), OUTDIR writable (fgout),
# this directory read-only (fgcwd), then the caller's shares and NICs. The serial console goes
# to CONSOLE; the status is qemu's, or timeout's (124, 137). `no_timer_check`: on a loaded host
# the emulated timer's first interrupts come late and the kernel's boot-time IO-APIC timer
# check panicked ("IO-APIC + timer doesn't work!"); the check proves nothing about the tests.
vm_boot() {
    local seconds="$1" cpus="$2" outdir="$3" console="$4"
    shift 4
    timeout -k 5 "$seconds" qemu-system-x86_64 \
        -accel tcg -cpu max -m 1024 -smp "$cpus" \
        -nographic -no-reboot -monitor none -serial stdio \
        -kernel "$KERNEL" -initrd "$INITRD" \
        -append "console=ttyS0 quiet loglevel=3 panic=-1 no_timer_check" \
        -virtfs "local,path=/,mount_tag=hostroot,security_model=passthrough,readonly=on,multidevs=remap" \
        -virtfs "local,path=$outdir,mount_tag=fgout,security_model=none" \
        -virtfs "local,path=$PWD,mount_tag=fgcwd,security_model=passthrough,readonly=on,multidevs=remap" \
        "$@" \
        </dev/null >"$console" 2>&1
}
