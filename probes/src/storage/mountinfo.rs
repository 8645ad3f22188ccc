//! `/proc/<pid>/mountinfo`: a pure parser over text, plus the lookups the probe needs.
//!
//! Line format (proc(5)):
//! `36 35 98:0 /mnt1 /mnt2 rw,noatime master:1 - ext3 /dev/root rw,errors=continue`
//! The kernel escapes space, tab, newline and backslash in paths as `\040`, `\011`, `\012`,
//! `\134`; they are decoded here, byte for byte, so non-UTF-8 paths survive.

use std::ffi::OsString;
use std::os::unix::ffi::OsStringExt;
use std::path::{Component, Path, PathBuf};

/// One mount, as the kernel lists it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MountEntry {
    pub mount_id: u32,
    pub parent_id: u32,
    /// `major:minor` of the device (`0:52`).
    pub device: String,
    /// Root of the mount within its file system (`/` unless a bind mount of a subtree).
    pub root: PathBuf,
    pub mount_point: PathBuf,
    /// Per-mount options (`rw,relatime`).
    pub mount_options: Vec<String>,
    /// `shared:1`, `master:2`, ...
    pub optional_fields: Vec<String>,
    pub fstype: String,
    pub source: String,
    /// Per-superblock options (`rw,flock,lazystatfs`).
    pub super_options: Vec<String>,
}

impl MountEntry {
    /// Mounted read-only, per mount or per superblock.
    pub fn is_read_only(&self) -> bool {
        self.mount_options
            .iter()
            .chain(&self.super_options)
            .any(|o| o == "ro")
    }
}

/// The parsed table, in kernel order (later entries stack on top of earlier ones).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct MountTable {
    pub entries: Vec<MountEntry>,
    /// Lines that could not be parsed: `line N: why`. The rest of the table is still used.
    pub bad_lines: Vec<String>,
}

impl MountTable {
    /// Parse the whole file; bad lines are recorded, not fatal.
    pub fn parse(text: &str) -> Self {
        let mut table = Self::default();
        for (i, line) in text.lines().enumerate() {
            if line.trim().is_empty() {
                continue;
            }
            match parse_line(line) {
                Ok(entry) => table.entries.push(entry),
                Err(why) => table.bad_lines.push(format!("line {}: {why}", i + 1)),
            }
        }
        table
    }

    /// The mount visible at exactly `path` (the last one stacked there).
    pub fn find(&self, path: &Path) -> Option<&MountEntry> {
        // The kernel prints canonical mount points, so only the query needs normalising
        // (Path equality already ignores repeated and trailing separators).
        let want = normalize(path);
        self.entries.iter().rev().find(|e| e.mount_point == want)
    }

    /// The mount that holds `path` (longest mount point that is a prefix of it).
    pub fn containing(&self, path: &Path) -> Option<&MountEntry> {
        let want = normalize(path);
        let mut best: Option<(usize, &MountEntry)> = None;
        for e in &self.entries {
            if !want.starts_with(&e.mount_point) {
                continue;
            }
            let depth = e.mount_point.components().count();
            // `>=` so that a later mount stacked on the same point wins.
            if best.is_none_or(|(d, _)| depth >= d) {
                best = Some((depth, e));
            }
        }
        best.map(|(_, e)| e)
    }

    /// Every mount of the given file-system type, in table order.
    pub fn of_type<'a>(&'a self, fstype: &'a str) -> impl Iterator<Item = &'a MountEntry> + 'a {
        self.entries.iter().filter(move |e| e.fstype == fstype)
    }
}

/// Lexical normalisation only: no file-system access, so a hung mount cannot block it.
pub fn normalize(path: &Path) -> PathBuf {
    let mut out = PathBuf::new();
    for c in path.components() {
        match c {
            Component::CurDir => {}
            Component::ParentDir => {
                out.pop();
            }
            other => out.push(other),
        }
    }
    out
}

fn parse_line(line: &str) -> Result<MountEntry, String> {
    let (head, tail) = line
        .split_once(" - ")
        .ok_or_else(|| "no ' - ' separator before the file-system type".to_owned())?;
    let mut fields = head.split(' ');
    let mut next = |what: &str| {
        fields
            .next()
            .filter(|f| !f.is_empty())
            .ok_or_else(|| format!("missing {what}"))
    };
    let mount_id = parse_id(next("mount ID")?, "mount ID")?;
    let parent_id = parse_id(next("parent ID")?, "parent ID")?;
    let device = next("major:minor")?.to_owned();
    let root = unescape_path(next("root")?);
    let mount_point = unescape_path(next("mount point")?);
    let mount_options = split_options(next("mount options")?);
    let optional_fields = fields
        .filter(|f| !f.is_empty())
        .map(str::to_owned)
        .collect();

    // The source may be empty on some pseudo file systems, so split exactly three ways.
    let mut rest = tail.splitn(3, ' ');
    let fstype = rest
        .next()
        .filter(|f| !f.is_empty())
        .ok_or_else(|| "missing file-system type".to_owned())?;
    let source = rest
        .next()
        .ok_or_else(|| "missing mount source".to_owned())?;
    let super_options = split_options(rest.next().unwrap_or(""));

    Ok(MountEntry {
        mount_id,
        parent_id,
        device,
        root,
        mount_point,
        mount_options,
        optional_fields,
        fstype: unescape_string(fstype),
        source: unescape_string(source),
        super_options,
    })
}

fn parse_id(s: &str, what: &str) -> Result<u32, String> {
    s.parse()
        .map_err(|_| format!("{what} {s:?} is not a number"))
}

fn split_options(s: &str) -> Vec<String> {
    s.split(',')
        .filter(|o| !o.is_empty())
        .map(unescape_string)
        .collect()
}

/// Decode the kernel's `\ooo` octal escapes; a backslash not followed by three octal digits
/// is kept as it is.
pub fn unescape(s: &str) -> Vec<u8> {
    let b = s.as_bytes();
    if !b.contains(&b'\\') {
        return b.to_vec();
    }
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'\\'
            && i + 3 < b.len()
            && b[i + 1..=i + 3].iter().all(|c| (b'0'..=b'7').contains(c))
        {
            let v = u32::from(b[i + 1] - b'0') * 64
                + u32::from(b[i + 2] - b'0') * 8
                + u32::from(b[i + 3] - b'0');
            if let Ok(byte) = u8::try_from(v) {
                out.push(byte);
                i += 4;
                continue;
            }
        }
        out.push(b[i]);
        i += 1;
    }
    out
}

fn unescape_path(s: &str) -> PathBuf {
    PathBuf::from(OsString::from_vec(unescape(s)))
}

fn unescape_string(s: &str) -> String {
    String::from_utf8_lossy(&unescape(s)).into_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    const SAMPLE: &str = "\
22 1 0:21 / /sys rw,nosuid,nodev,noexec,relatime shared:7 - sysfs sysfs rw
25 1 259:2 / / rw,relatime shared:1 - ext4 /dev/nvme0n1p2 rw,errors=remount-ro
321 25 0:52 / /lustre/scratch rw,relatime shared:180 - lustre 10.1.1.1@o2ib:10.1.1.2@o2ib:/scratch rw,checksum,flock,lruresize,lazystatfs,nouser_fid2path,verbose,encrypt
330 25 0:60 / /datasets ro,relatime shared:190 - nfs4 nfs1:/export/datasets ro,vers=4.2,rsize=1048576,wsize=1048576,hard,proto=tcp,timeo=600,retrans=2,sec=sys,clientaddr=10.0.0.5
340 25 0:61 / /mnt/with\\040space\\011tab\\012nl\\134bs rw,relatime - tmpfs none rw,size=1024k
";

    #[test]
    fn parses_every_field() {
        let t = MountTable::parse(SAMPLE);
        assert!(t.bad_lines.is_empty(), "{:?}", t.bad_lines);
        assert_eq!(t.entries.len(), 5);
        let l = &t.entries[2];
        assert_eq!(l.mount_id, 321);
        assert_eq!(l.parent_id, 25);
        assert_eq!(l.device, "0:52");
        assert_eq!(l.root, PathBuf::from("/"));
        assert_eq!(l.mount_point, PathBuf::from("/lustre/scratch"));
        assert_eq!(l.mount_options, vec!["rw", "relatime"]);
        assert_eq!(l.optional_fields, vec!["shared:180"]);
        assert_eq!(l.fstype, "lustre");
        assert_eq!(l.source, "10.1.1.1@o2ib:10.1.1.2@o2ib:/scratch");
        assert!(l.super_options.contains(&"flock".to_owned()));
        assert!(!l.is_read_only());
        assert!(t.entries[3].is_read_only());
    }

    #[test]
    fn decodes_octal_escapes_in_paths() {
        let t = MountTable::parse(SAMPLE);
        let m = &t.entries[4];
        assert_eq!(m.mount_point, PathBuf::from("/mnt/with space\ttab\nnl\\bs"),);
        assert!(t.find(Path::new("/mnt/with space\ttab\nnl\\bs")).is_some());
        assert_eq!(unescape(r"a\040b"), b"a b");
        assert_eq!(unescape(r"\011\012\134"), b"\t\n\\");
        // Not an escape: kept literally.
        assert_eq!(unescape(r"a\04"), b"a\\04");
        assert_eq!(unescape(r"a\9xx"), b"a\\9xx");
        assert_eq!(unescape(r"end\"), b"end\\");
        // Non-UTF-8 bytes survive in paths.
        let t = MountTable::parse("1 0 0:1 / /x\\377y rw - tmpfs none rw\n");
        use std::os::unix::ffi::OsStrExt;
        assert_eq!(t.entries[0].mount_point.as_os_str().as_bytes(), b"/x\xffy");
    }

    #[test]
    fn lookups_take_the_top_of_the_stack_and_the_longest_prefix() {
        let text = format!("{SAMPLE}400 321 0:70 / /lustre/scratch rw - tmpfs over rw\n");
        let t = MountTable::parse(&text);
        assert_eq!(
            t.find(Path::new("/lustre/scratch/")).unwrap().fstype,
            "tmpfs"
        );
        assert_eq!(
            t.containing(Path::new("/lustre/scratch/a/b"))
                .unwrap()
                .fstype,
            "tmpfs"
        );
        assert_eq!(
            t.containing(Path::new("/lustre/other")).unwrap().fstype,
            "ext4"
        );
        assert!(t.find(Path::new("/lustre")).is_none());
        assert_eq!(t.of_type("lustre").count(), 1);
        assert_eq!(
            t.find(Path::new("/lustre/./scratch")).map(|e| e.mount_id),
            Some(400)
        );
    }

    #[test]
    fn bad_lines_are_reported_and_skipped() {
        let t = MountTable::parse(
            "garbage\nx 1 0:1 / / rw - ext4 /dev/sda rw\n25 1 259:2 / / rw - ext4 /dev/sda rw\n",
        );
        assert_eq!(t.entries.len(), 1);
        assert_eq!(t.bad_lines.len(), 2);
        assert!(t.bad_lines[0].starts_with("line 1:"), "{:?}", t.bad_lines);
        assert!(t.bad_lines[1].contains("mount ID"), "{:?}", t.bad_lines);
    }

    #[test]
    fn empty_source_and_missing_super_options_parse() {
        let t = MountTable::parse(
            "30 25 0:40 / /run/x rw - tmpfs  rw\n31 25 0:41 / /y rw - proc proc\n",
        );
        assert!(t.bad_lines.is_empty(), "{:?}", t.bad_lines);
        assert_eq!(t.entries[0].source, "");
        assert_eq!(t.entries[0].super_options, vec!["rw"]);
        assert!(t.entries[1].super_options.is_empty());
    }
}
