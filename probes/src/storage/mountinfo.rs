//! `/proc/<pid>/mountinfo`: a pure parser over bytes, plus the lookups the probe needs.
//!
//! Line format (proc(5)):
//! `36 35 98:0 /mnt1 /mnt2 rw,noatime master:1 - ext3 /dev/root rw,errors=continue`
//! The kernel escapes space, tab, newline and backslash in paths as `\040`, `\011`, `\012`,
//! `\134` and prints every other byte as it is, so a path may hold any byte sequence (UTF-8
//! or not). Paths are decoded byte for byte into `OsStr`; the other fields are text (bytes
//! that are not UTF-8 there are replaced and the line is still used). A line that does not
//! have the fields of a mount is reported and skipped; the rest of the table is used.
//!
//! The table is one buffer: entries are spans into it, so parsing allocates nothing per line
//! (2,000 lines in well under a millisecond).

use std::collections::HashMap;
use std::ffi::OsStr;
use std::fs::File;
use std::io;
use std::os::unix::ffi::OsStrExt;
use std::path::{Component, Path, PathBuf};
use std::sync::Arc;

/// One mount, as the kernel lists it (borrowed from its [`MountTable`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MountEntry<'a> {
    pub mount_id: u32,
    pub parent_id: u32,
    /// `major:minor` of the device (`0:52`).
    pub device: &'a str,
    /// Root of the mount within its file system (`/` unless a bind mount of a subtree).
    pub root: &'a Path,
    pub mount_point: &'a Path,
    /// Per-mount options, comma-separated as printed (`rw,relatime`).
    pub mount_options: &'a str,
    /// `shared:1 master:2 ...`, space-separated as printed.
    pub optional_fields: &'a str,
    pub fstype: &'a str,
    pub source: &'a str,
    /// Per-superblock options, comma-separated (`rw,flock,lazystatfs`).
    pub super_options: &'a str,
}

impl<'a> MountEntry<'a> {
    /// Mounted read-only, per mount or per superblock.
    pub fn is_read_only(&self) -> bool {
        self.mount_options
            .split(',')
            .chain(self.super_options.split(','))
            .any(|o| o == "ro")
    }

    /// The per-mount options one by one.
    pub fn mount_options(&self) -> impl Iterator<Item = &'a str> + 'a {
        self.mount_options.split(',').filter(|o| !o.is_empty())
    }

    /// The per-superblock options one by one.
    pub fn super_options(&self) -> impl Iterator<Item = &'a str> + 'a {
        self.super_options.split(',').filter(|o| !o.is_empty())
    }

    /// The optional fields one by one (`shared:1`, `master:2`).
    pub fn optional_fields(&self) -> impl Iterator<Item = &'a str> + 'a {
        self.optional_fields.split(' ').filter(|o| !o.is_empty())
    }
}

/// A byte range in the table's buffer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
struct Span {
    start: u32,
    end: u32,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Spans {
    mount_id: u32,
    parent_id: u32,
    device: Span,
    root: Span,
    mount_point: Span,
    mount_options: Span,
    optional_fields: Span,
    fstype: Span,
    source: Span,
    super_options: Span,
}

/// The parsed table, in kernel order (later entries stack on top of earlier ones).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct MountTable {
    /// The file as read.
    buf: Vec<u8>,
    /// Decoded fields; a span at or past `buf.len()` points here.
    extra: Vec<u8>,
    spans: Vec<Spans>,
    /// Lines that could not be parsed: `line N: why`. The rest of the table is still used.
    pub bad_lines: Vec<String>,
}

/// Longest table parsed (10,000 mounts take about 2 MB); spans are `u32`, and decoded copies
/// at most triple the size. A larger file is cut there (and reported).
pub const MAX_TABLE_BYTES: usize = 256 * 1024 * 1024;

impl MountTable {
    /// Parse the whole file; bad lines are recorded, not fatal.
    pub fn parse(text: impl AsRef<[u8]>) -> Self {
        Self::from_bytes(text.as_ref().to_vec())
    }

    /// Parse a file read into `buf` (no copy).
    ///
    /// Fields are spans into `buf`, found with `memchr` (a short scalar scan first): only
    /// the fields before the lone `-` and the two after it are split; the super options are
    /// the rest of the line. One pass finds every backslash, so only a line with one has its
    /// fields decoded; one UTF-8 check of the whole table spares the per-field checks. Decoded
    /// copies go to a side buffer. Nothing is allocated per line.
    pub fn from_bytes(mut buf: Vec<u8>) -> Self {
        let mut bad_lines = Vec::new();
        if buf.len() > MAX_TABLE_BYTES {
            buf.truncate(MAX_TABLE_BYTES);
            bad_lines.push(format!(
                "the table is longer than {MAX_TABLE_BYTES} bytes; the rest is ignored"
            ));
        }
        let input = buf.as_slice();
        let mut extra = Extra {
            base: input.len(),
            bytes: Vec::new(),
            all_utf8: std::str::from_utf8(input).is_ok(),
        };
        let backslashes: Vec<usize> = memchr::memchr_iter(b'\\', input).collect();
        let mut next_backslash = 0usize;
        let mut spans = Vec::with_capacity(input.len() / 128);
        let mut start = 0usize;
        let mut line_no = 0usize;
        while start < input.len() {
            let end = memchr(b'\n', &input[start..]).map_or(input.len(), |i| start + i);
            line_no += 1;
            while backslashes.get(next_backslash).is_some_and(|&i| i < start) {
                next_backslash += 1;
            }
            let first = next_backslash;
            while backslashes.get(next_backslash).is_some_and(|&i| i < end) {
                next_backslash += 1;
            }
            let escapes = &backslashes[first..next_backslash];
            let line = start..end;
            start = end + 1;
            if input[line.clone()].iter().all(u8::is_ascii_whitespace) {
                continue;
            }
            match parse_line(input, line, escapes, &mut extra) {
                Ok(s) => spans.push(s),
                Err(why) => bad_lines.push(format!("line {line_no}: {why}")),
            }
        }
        Self {
            buf,
            extra: extra.bytes,
            spans,
            bad_lines,
        }
    }

    /// Number of entries.
    pub fn len(&self) -> usize {
        self.spans.len()
    }

    pub fn is_empty(&self) -> bool {
        self.spans.is_empty()
    }

    fn bytes(&self, s: Span) -> &[u8] {
        let (start, end) = (s.start as usize, s.end as usize);
        match start.checked_sub(self.buf.len()) {
            Some(at) => &self.extra[at..at + (end - start)],
            None => &self.buf[start..end],
        }
    }

    /// Text fields were made valid UTF-8 when parsed.
    fn str(&self, s: Span) -> &str {
        std::str::from_utf8(self.bytes(s)).unwrap_or("")
    }

    fn path(&self, s: Span) -> &Path {
        Path::new(OsStr::from_bytes(self.bytes(s)))
    }

    fn entry(&self, s: &Spans) -> MountEntry<'_> {
        MountEntry {
            mount_id: s.mount_id,
            parent_id: s.parent_id,
            device: self.str(s.device),
            root: self.path(s.root),
            mount_point: self.path(s.mount_point),
            mount_options: self.str(s.mount_options),
            optional_fields: self.str(s.optional_fields),
            fstype: self.str(s.fstype),
            source: self.str(s.source),
            super_options: self.str(s.super_options),
        }
    }

    /// Every entry, in table order.
    pub fn entries(&self) -> impl DoubleEndedIterator<Item = MountEntry<'_>> + ExactSizeIterator {
        self.spans.iter().map(|s| self.entry(s))
    }

    /// The entry at `index` in table order.
    pub fn get(&self, index: usize) -> Option<MountEntry<'_>> {
        self.spans.get(index).map(|s| self.entry(s))
    }

    /// The mount visible at exactly `path` (the last one stacked there). Linear; for many
    /// lookups use [`MountTable::index`].
    pub fn find(&self, path: &Path) -> Option<MountEntry<'_>> {
        // The kernel prints canonical mount points, so only the query needs normalising
        // (Path equality already ignores repeated and trailing separators).
        let want = normalize(path);
        self.entries().rev().find(|e| e.mount_point == want)
    }

    /// An index from mount point to the visible (last stacked) entry: O(n) to build, O(1)
    /// per lookup.
    pub fn index(&self) -> MountIndex<'_> {
        let mut by_point: HashMap<&[u8], usize> = HashMap::with_capacity(self.spans.len());
        for (i, s) in self.spans.iter().enumerate() {
            by_point.insert(self.bytes(s.mount_point), i);
        }
        MountIndex {
            table: self,
            by_point,
        }
    }

    /// The mount that holds `path` (longest mount point that is a prefix of it).
    pub fn containing(&self, path: &Path) -> Option<MountEntry<'_>> {
        let want = normalize(path);
        let mut best: Option<(usize, MountEntry<'_>)> = None;
        for e in self.entries() {
            if !want.starts_with(e.mount_point) {
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
    pub fn of_type<'a>(&'a self, fstype: &'a str) -> impl Iterator<Item = MountEntry<'a>> + 'a {
        self.spans
            .iter()
            .filter(move |s| self.bytes(s.fstype) == fstype.as_bytes())
            .map(|s| self.entry(s))
    }
}

/// Mount point → visible entry, for many lookups in one table.
#[derive(Debug)]
pub struct MountIndex<'a> {
    table: &'a MountTable,
    by_point: HashMap<&'a [u8], usize>,
}

impl<'a> MountIndex<'a> {
    /// The mount visible at exactly `path` (the last one stacked there).
    pub fn find(&self, path: &Path) -> Option<MountEntry<'a>> {
        let want = normalize(path);
        let i = *self.by_point.get(want.as_os_str().as_bytes())?;
        self.table.get(i)
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

fn memchr(needle: u8, hay: &[u8]) -> Option<usize> {
    memchr::memchr(needle, hay)
}

/// Decoded copies of fields, kept next to the input.
struct Extra {
    /// Length of the input: a span at or past it points into `bytes`.
    base: usize,
    bytes: Vec<u8>,
    /// The whole input is valid UTF-8, so a field without escapes needs no check.
    all_utf8: bool,
}

impl Extra {
    fn get<'a>(&'a self, input: &'a [u8], r: std::ops::Range<usize>) -> &'a [u8] {
        if r.start >= self.base {
            &self.bytes[r.start - self.base..r.end - self.base]
        } else {
            &input[r]
        }
    }
}

/// Where the next space is in `hay`: eight bytes at a time for the first 32 (most fields
/// are short: ids, `major:minor`, `/`, options), then `memchr`.
fn find_space(hay: &[u8]) -> Option<usize> {
    const SHORT: usize = 32;
    const ONES: u64 = 0x0101_0101_0101_0101;
    const HIGHS: u64 = 0x8080_8080_8080_8080;
    let mut i = 0;
    while i < SHORT && i + 8 <= hay.len() {
        let mut word = [0u8; 8];
        word.copy_from_slice(&hay[i..i + 8]);
        // A zero byte of `x` is a space of `hay`; the lowest flagged byte is the first one.
        let x = u64::from_le_bytes(word) ^ (ONES * u64::from(b' '));
        let found = x.wrapping_sub(ONES) & !x & HIGHS;
        if found != 0 {
            return Some(i + (found.trailing_zeros() / 8) as usize);
        }
        i += 8;
    }
    if i < SHORT {
        return hay[i..].iter().position(|&b| b == b' ').map(|j| i + j);
    }
    memchr(b' ', &hay[i..]).map(|j| i + j)
}

/// Split off the next space-separated field of `input[*pos..end]` (empty fields included).
fn next_field(input: &[u8], pos: &mut usize, end: usize) -> Option<std::ops::Range<usize>> {
    if *pos > end {
        return None;
    }
    let start = *pos;
    let stop = find_space(&input[start..end]).map_or(end, |i| start + i);
    *pos = stop + 1;
    Some(start..stop)
}

/// The first field at or after `pos` that is a lone `-` (`pos` starts a field); its index.
fn find_dash(input: &[u8], pos: usize, end: usize) -> Option<usize> {
    let mut at = pos;
    while at < end {
        let i = at + memchr(b'-', &input[at..end])?;
        let starts = i == pos || input[i - 1] == b' ';
        let ends = i + 1 == end || input[i + 1] == b' ';
        if starts && ends {
            return Some(i);
        }
        at = i + 1;
    }
    None
}

fn parse_line(
    input: &[u8],
    line: std::ops::Range<usize>,
    escapes: &[usize],
    extra: &mut Extra,
) -> Result<Spans, String> {
    let end = line.end;
    let mut pos = line.start;
    let mut next = |what: &str| {
        next_field(input, &mut pos, end)
            .filter(|r| !r.is_empty())
            .ok_or_else(|| format!("missing {what}"))
    };
    let mount_id = parse_id(&input[next("mount ID")?], "mount ID")?;
    let parent_id = parse_id(&input[next("parent ID")?], "parent ID")?;
    let device = next("major:minor")?;
    let root = next("root")?;
    let mount_point = next("mount point")?;
    let mount_options = next("mount options")?;
    // Optional fields up to the lone `-`.
    let no_separator = || "no ' - ' separator before the file-system type".to_owned();
    if pos > end {
        return Err(no_separator());
    }
    let dash = find_dash(input, pos, end).ok_or_else(no_separator)?;
    // The optional fields end before the space in front of the `-` (none when it is first).
    let optional_fields = pos..(dash.saturating_sub(1)).max(pos);
    pos = dash + 2;
    let fstype = next_field(input, &mut pos, end)
        .filter(|r| !r.is_empty())
        .ok_or_else(|| "missing file-system type".to_owned())?;
    // The source may be empty on some pseudo file systems.
    let source =
        next_field(input, &mut pos, end).ok_or_else(|| "missing mount source".to_owned())?;
    // The super options are the rest of the line (they hold no unescaped spaces).
    let super_options = if pos <= end { pos..end } else { end..end };

    Ok(Spans {
        mount_id,
        parent_id,
        device: text(input, extra, device, escapes),
        root: span(path_field(input, extra, root, escapes)),
        mount_point: span(path_field(input, extra, mount_point, escapes)),
        mount_options: text(input, extra, mount_options, escapes),
        optional_fields: text(input, extra, optional_fields, escapes),
        fstype: text(input, extra, fstype, escapes),
        source: text(input, extra, source, escapes),
        super_options: text(input, extra, super_options, escapes),
    })
}

fn parse_id(s: &[u8], what: &str) -> Result<u32, String> {
    let mut v: u32 = 0;
    if s.is_empty() || s.len() > 10 {
        return Err(format!(
            "{what} {:?} is not a number",
            s.escape_ascii().to_string()
        ));
    }
    for &b in s {
        if !b.is_ascii_digit() {
            return Err(format!(
                "{what} {:?} is not a number",
                s.escape_ascii().to_string()
            ));
        }
        v = v
            .checked_mul(10)
            .and_then(|v| v.checked_add(u32::from(b - b'0')))
            .ok_or_else(|| format!("{what} {:?} is too large", s.escape_ascii().to_string()))?;
    }
    Ok(v)
}

fn span(r: std::ops::Range<usize>) -> Span {
    // Bounded by MAX_TABLE_BYTES (plus decoded copies no longer than the input).
    Span {
        start: u32::try_from(r.start).unwrap_or(u32::MAX),
        end: u32::try_from(r.end).unwrap_or(u32::MAX),
    }
}

/// Whether one of the line's backslashes (`escapes`, sorted) is in `r`.
fn has_escape(escapes: &[usize], r: &std::ops::Range<usize>) -> bool {
    escapes.iter().any(|i| r.contains(i))
}

/// A path field: borrowed as it is unless it holds a backslash (then decoded into `extra`).
fn path_field(
    input: &[u8],
    extra: &mut Extra,
    r: std::ops::Range<usize>,
    escapes: &[usize],
) -> std::ops::Range<usize> {
    if !has_escape(escapes, &r) {
        return r;
    }
    let start = extra.base + extra.bytes.len();
    decode_into(&input[r], &mut extra.bytes);
    start..extra.base + extra.bytes.len()
}

/// A text field: decoded like a path, then made valid UTF-8 (invalid bytes replaced).
fn text(input: &[u8], extra: &mut Extra, r: std::ops::Range<usize>, escapes: &[usize]) -> Span {
    if extra.all_utf8 && !has_escape(escapes, &r) {
        return span(r);
    }
    let d = path_field(input, extra, r, escapes);
    let bytes = extra.get(input, d.clone());
    if std::str::from_utf8(bytes).is_ok() {
        return span(d);
    }
    let fixed = String::from_utf8_lossy(bytes).into_owned();
    let start = extra.base + extra.bytes.len();
    extra.bytes.extend_from_slice(fixed.as_bytes());
    span(start..extra.base + extra.bytes.len())
}

/// Append `field` to `out` with its `\ooo` octal escapes decoded; a backslash not followed by
/// three octal digits (of a value up to 255) is kept as it is.
fn decode_into(field: &[u8], out: &mut Vec<u8>) {
    let mut i = 0;
    while i < field.len() {
        // Copy up to the next backslash in one go.
        let next = memchr(b'\\', &field[i..]).map_or(field.len(), |j| i + j);
        out.extend_from_slice(&field[i..next]);
        i = next;
        if i >= field.len() {
            break;
        }
        if i + 3 < field.len()
            && field[i + 1..i + 4]
                .iter()
                .all(|c| (b'0'..=b'7').contains(c))
        {
            let v = u32::from(field[i + 1] - b'0') * 64
                + u32::from(field[i + 2] - b'0') * 8
                + u32::from(field[i + 3] - b'0');
            if let Ok(byte) = u8::try_from(v) {
                out.push(byte);
                i += 4;
                continue;
            }
        }
        out.push(b'\\');
        i += 1;
    }
}

/// Decode the kernel's `\ooo` octal escapes; a backslash not followed by three octal digits
/// is kept as it is.
pub fn unescape(s: &str) -> Vec<u8> {
    let mut out = Vec::with_capacity(s.len());
    decode_into(s.as_bytes(), &mut out);
    out
}

/// `<procfs>/self/mountinfo` kept open between probes and re-parsed only when it changed.
///
/// The kernel flags a change of the mount namespace to every open `mountinfo` file: `poll`
/// returns `POLLPRI` once after each change. A file that is not on procfs (a fixture) gives
/// no such signal, so it is re-read on every probe.
#[derive(Debug, Default)]
pub struct MountTableFile {
    open: Option<OpenTable>,
    /// Times the table was read and parsed (for tests and benchmarks).
    parses: u64,
}

#[derive(Debug)]
struct OpenTable {
    path: PathBuf,
    file: File,
    /// On procfs: `poll` says when the table changed.
    pollable: bool,
    table: Arc<MountTable>,
}

/// `PROC_SUPER_MAGIC`.
const PROC_SUPER_MAGIC: u64 = 0x9fa0;

impl MountTableFile {
    /// The current table at `path`: the cached one when the kernel says nothing changed,
    /// else read (bounded: regular files only, at most [`MAX_TABLE_BYTES`]) and parsed.
    pub fn table(&mut self, path: &Path) -> io::Result<Arc<MountTable>> {
        if let Some(open) = self.open.as_ref().filter(|o| o.path == path)
            && open.pollable
            && !changed(&open.file)
        {
            return Ok(Arc::clone(&open.table));
        }
        let reuse = self.open.take().filter(|o| o.path == path);
        let (file, pollable) = match reuse {
            Some(o) => (o.file, o.pollable),
            None => {
                let file = crate::sysfs_io::open_regular(path)
                    .map_err(|e| io::Error::other(e.to_string()))?
                    .ok_or_else(|| io::Error::from_raw_os_error(libc::ENOENT))?;
                let pollable = rustix::fs::fstatfs(&file).is_ok_and(|s| is_proc(s.f_type));
                (file, pollable)
            }
        };
        let bytes = read_all(&file)?;
        self.parses += 1;
        let table = Arc::new(MountTable::from_bytes(bytes));
        self.open = Some(OpenTable {
            path: path.to_owned(),
            file,
            pollable,
            table: Arc::clone(&table),
        });
        Ok(table)
    }

    /// How many times the table was read and parsed.
    pub fn parses(&self) -> u64 {
        self.parses
    }
}

/// `f_type` is a signed long (i32 on 32-bit targets): compare its low 32 bits.
#[allow(clippy::useless_conversion)]
fn is_proc(f_type: impl Into<i64>) -> bool {
    (f_type.into() as u64) & 0xFFFF_FFFF == PROC_SUPER_MAGIC
}

/// `POLLPRI` (or `POLLERR`) on a procfs `mountinfo`: the mount table changed since the last
/// `poll`. A failing `poll` counts as a change.
fn changed(file: &File) -> bool {
    use rustix::event::{PollFd, PollFlags, Timespec, poll};
    let mut fds = [PollFd::new(file, PollFlags::PRI)];
    let zero = Timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    match poll(&mut fds, Some(&zero)) {
        Ok(_) => fds[0]
            .revents()
            .intersects(PollFlags::PRI | PollFlags::ERR | PollFlags::NVAL),
        Err(_) => true,
    }
}

/// The whole file from offset 0, at most [`MAX_TABLE_BYTES`] (+1, to see the cut).
fn read_all(file: &File) -> io::Result<Vec<u8>> {
    crate::sysfs_io::read_prefix(file, 64 * 1024, MAX_TABLE_BYTES + 1)
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
        assert_eq!(t.len(), 5);
        let l = t.get(2).unwrap();
        assert_eq!(l.mount_id, 321);
        assert_eq!(l.parent_id, 25);
        assert_eq!(l.device, "0:52");
        assert_eq!(l.root, Path::new("/"));
        assert_eq!(l.mount_point, Path::new("/lustre/scratch"));
        assert_eq!(
            l.mount_options().collect::<Vec<_>>(),
            vec!["rw", "relatime"]
        );
        assert_eq!(l.optional_fields().collect::<Vec<_>>(), vec!["shared:180"]);
        assert_eq!(l.fstype, "lustre");
        assert_eq!(l.source, "10.1.1.1@o2ib:10.1.1.2@o2ib:/scratch");
        assert!(l.super_options().any(|o| o == "flock"));
        assert!(!l.is_read_only());
        assert!(t.get(3).unwrap().is_read_only());
    }

    #[test]
    fn decodes_octal_escapes_in_paths() {
        let t = MountTable::parse(SAMPLE);
        let m = t.get(4).unwrap();
        assert_eq!(m.mount_point, Path::new("/mnt/with space\ttab\nnl\\bs"));
        assert!(t.find(Path::new("/mnt/with space\ttab\nnl\\bs")).is_some());
        assert_eq!(unescape(r"a\040b"), b"a b");
        assert_eq!(unescape(r"\011\012\134"), b"\t\n\\");
        // Not an escape: kept literally.
        assert_eq!(unescape(r"a\04"), b"a\\04");
        assert_eq!(unescape(r"a\9xx"), b"a\\9xx");
        assert_eq!(unescape(r"end\"), b"end\\");
        // Non-UTF-8 bytes survive in paths.
        let t = MountTable::parse("1 0 0:1 / /x\\377y rw - tmpfs none rw\n");
        assert_eq!(
            t.get(0).unwrap().mount_point.as_os_str().as_bytes(),
            b"/x\xffy"
        );
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
        assert_eq!(t.len(), 1);
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
        assert_eq!(t.get(0).unwrap().source, "");
        assert_eq!(t.get(0).unwrap().super_options, "rw");
        assert!(t.get(1).unwrap().super_options.is_empty());
    }

    #[test]
    fn a_fixture_table_is_re_read_on_every_probe() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("mountinfo");
        std::fs::write(&path, "25 1 259:2 / / rw - ext4 /dev/sda rw\n").unwrap();
        let mut file = MountTableFile::default();
        assert_eq!(file.table(&path).unwrap().len(), 1);
        std::fs::write(
            &path,
            "25 1 259:2 / / rw - ext4 /dev/sda rw\n30 25 0:52 / /x rw - tmpfs none rw\n",
        )
        .unwrap();
        assert_eq!(file.table(&path).unwrap().len(), 2);
        assert_eq!(file.parses(), 2);
        let fifo = dir.path().join("fifo");
        let made = std::process::Command::new("mkfifo").arg(&fifo).status();
        assert!(made.is_ok_and(|s| s.success()));
        let e = file.table(&fifo).unwrap_err().to_string();
        assert!(e.contains("FIFO"), "{e}");
        let e = file.table(&dir.path().join("none")).unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::NotFound);
    }

    /// A plain reference parser (split, allocate, decode every field): what the one-pass
    /// parser must agree with.
    fn reference(bytes: &[u8]) -> (Vec<Vec<Vec<u8>>>, usize) {
        fn decode(f: &[u8]) -> Vec<u8> {
            let mut out = Vec::new();
            decode_into(f, &mut out);
            out
        }
        fn text(f: &[u8]) -> Vec<u8> {
            String::from_utf8_lossy(&decode(f))
                .into_owned()
                .into_bytes()
        }
        fn id(f: &[u8]) -> Option<Vec<u8>> {
            let ok = !f.is_empty() && f.len() <= 10 && f.iter().all(u8::is_ascii_digit);
            let v: u32 = std::str::from_utf8(f).ok().filter(|_| ok)?.parse().ok()?;
            Some(v.to_string().into_bytes())
        }
        let (mut entries, mut bad) = (Vec::new(), 0);
        for line in bytes.split(|&b| b == b'\n') {
            if line.iter().all(u8::is_ascii_whitespace) {
                continue;
            }
            let f: Vec<&[u8]> = line.split(|&b| b == b' ').collect();
            let parsed = (|| {
                if f.len() < 6 || f[..6].iter().any(|x| x.is_empty()) {
                    return None;
                }
                let dash = 6 + f[6..].iter().position(|x| *x == b"-")?;
                let fstype = f.get(dash + 1).filter(|x| !x.is_empty())?;
                let source = f.get(dash + 2)?;
                let sup = f.get(dash + 3..).map_or(Vec::new(), |r| r.join(&b' '));
                Some(vec![
                    id(f[0])?,
                    id(f[1])?,
                    text(f[2]),
                    decode(f[3]),
                    decode(f[4]),
                    text(f[5]),
                    text(&f[6..dash].join(&b' ')),
                    text(fstype),
                    text(source),
                    text(&sup),
                ])
            })();
            match parsed {
                Some(e) => entries.push(e),
                None => bad += 1,
            }
        }
        (entries, bad)
    }

    fn fields(e: &MountEntry<'_>) -> Vec<Vec<u8>> {
        vec![
            e.mount_id.to_string().into_bytes(),
            e.parent_id.to_string().into_bytes(),
            e.device.as_bytes().to_vec(),
            e.root.as_os_str().as_bytes().to_vec(),
            e.mount_point.as_os_str().as_bytes().to_vec(),
            e.mount_options.as_bytes().to_vec(),
            e.optional_fields.as_bytes().to_vec(),
            e.fstype.as_bytes().to_vec(),
            e.source.as_bytes().to_vec(),
            e.super_options.as_bytes().to_vec(),
        ]
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig::with_cases(1024))]

        /// Lines built from the tokens that matter (separators, escapes, non-UTF-8 bytes, empty
        /// fields, numbers): the one-pass parser and the reference agree field by field.
        #[test]
        fn one_pass_parser_agrees_with_the_reference(
            lines in proptest::collection::vec(
                proptest::collection::vec(
                    proptest::sample::select(vec![
                        "", "-", "25", "1", "4294967296", "+5", "0:52", "/", "/a\\040b",
                        "/x\\377", "\\", "\\4", "rw,relatime", "shared:1", "master:2",
                        "ext4", "nfs4", "\u{e9}", "srv:/e", "a\tb", "\r",
                    ]),
                    0..14,
                ),
                0..12,
            ),
            raw in proptest::collection::vec(proptest::prelude::any::<u8>(), 0..8),
        ) {
            let mut text: Vec<u8> = Vec::new();
            for l in &lines {
                text.extend_from_slice(l.join(" ").as_bytes());
                text.push(b'\n');
            }
            text.extend_from_slice(&raw);
            let t = MountTable::parse(&text);
            let (want, bad) = reference(&text);
            let got: Vec<Vec<Vec<u8>>> = t.entries().map(|e| fields(&e)).collect();
            proptest::prop_assert_eq!(got, want);
            proptest::prop_assert_eq!(t.bad_lines.len(), bad);
        }
    }

    /// On procfs the table is parsed again only after `poll` says it changed. Other tests
    /// may mount things meanwhile, so one of a few back-to-back pairs must hit the cache.
    #[test]
    fn the_live_table_is_reused_until_the_kernel_says_it_changed() {
        let path = Path::new("/proc/self/mountinfo");
        let mut file = MountTableFile::default();
        let mut reused = false;
        for _ in 0..5 {
            let a = file.table(path).unwrap();
            let b = file.table(path).unwrap();
            if Arc::ptr_eq(&a, &b) {
                reused = true;
                break;
            }
        }
        assert!(
            reused,
            "every read of /proc/self/mountinfo was parsed again"
        );
        assert!(file.open.as_ref().is_some_and(|o| o.pollable));
    }
}
