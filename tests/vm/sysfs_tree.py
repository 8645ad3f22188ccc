#!/usr/bin/env python3
"""Copy what a sysfs mount shows of the RDMA classes into a fixture tree, byte for byte:
SYSFS/class/infiniband/* and SYSFS/class/infiniband_verbs/* (symlinks as the same symlinks,
files such as `abi_version` copied) into OUT/sys/class/... (the layout of
tests/fixtures/*/sys). The devices' own folders are left out: what differs between two
network namespaces' views is which class entries exist. A class folder that is empty in this
view gets a `.keep` file so that git keeps it. Used by tests/vm/capture-netns.sh for the
host's and a network namespace's view.

    tests/vm/sysfs_tree.py SYSFS OUT
"""
import os
import sys


def main():
    sysfs, out = sys.argv[1], sys.argv[2]
    for cls in ("infiniband", "infiniband_verbs"):
        cdir = os.path.join(sysfs, "class", cls)
        odir = os.path.join(out, "sys", "class", cls)
        os.makedirs(odir, exist_ok=True)
        names = sorted(os.listdir(cdir)) if os.path.isdir(cdir) else []
        if not names:
            open(os.path.join(odir, ".keep"), "w").close()
        for name in names:
            src, dst = os.path.join(cdir, name), os.path.join(odir, name)
            if os.path.islink(src):
                os.symlink(os.readlink(src), dst)
                print(f"{cls}/{name} -> {os.readlink(src)}")
            else:
                with open(src, "rb") as f, open(dst, "wb") as g:
                    g.write(f.read())
                print(f"{cls}/{name}")


if __name__ == "__main__":
    main()
