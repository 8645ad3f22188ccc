//! Reading sysfs-style attribute files and directories: the I/O every probe shares, so each
//! treats absence (`None`), read errors and malformed content the same way.
//!
//! Reads are bounded: a file is opened with `O_NONBLOCK | O_CLOEXEC` and read only when
//! `fstat` says it is a regular file (sysfs attributes are), so a FIFO where `rate` should be
//! or a symlink to `/dev/zero` is a per-attribute error naming the path, never a hang; and no
//! more than [`MAX_ATTR_BYTES`] are read from any file.
//!
//! The probe keeps its attribute files open ([`Attr`]) and re-reads each with one `pread` at
//! offset 0 (kernfs regenerates the value on every read from offset 0).

use crate::error::ProbeError;
use crate::kept_files::{self, Kept};
use std::ffi::OsString;
use std::fs::{self, File, OpenOptions};
use std::io;
use std::os::unix::fs::{FileExt, FileTypeExt, MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

/// Largest attribute read: a sysfs attribute is at most one page (64 KiB on arm64/ppc64le
/// kernels with large pages); anything bigger is not an attribute.
pub const MAX_ATTR_BYTES: usize = 64 * 1024;

/// First read size: more than a 4 KiB page, so a sysfs attribute always comes back in one
/// short `pread` (a full buffer would need a second call to see the end).
const FIRST_READ: usize = 8 * 1024;

/// A reusable read buffer, zeroed once: reading never clears or re-initialises it.
pub(crate) struct AttrBuf {
    data: Vec<u8>,
    len: usize,
}

impl Default for AttrBuf {
    fn default() -> Self {
        Self::new()
    }
}

impl AttrBuf {
    pub(crate) fn new() -> Self {
        Self {
            data: vec![0; FIRST_READ],
            len: 0,
        }
    }

    pub(crate) fn bytes(&self) -> &[u8] {
        &self.data[..self.len]
    }

    /// Read all of `file` from offset 0: one `pread` for anything shorter than the buffer.
    /// A short read is the end of the file, for sysfs and regular files alike.
    fn fill(&mut self, file: &File, path: &Path) -> Result<(), ProbeError> {
        self.len = 0;
        loop {
            if self.len == self.data.len() {
                if self.len > MAX_ATTR_BYTES {
                    return Err(ProbeError::TooLarge {
                        path: path.to_owned(),
                        limit: MAX_ATTR_BYTES,
                    });
                }
                let grown = (self.data.len() * 2).min(MAX_ATTR_BYTES + 1);
                self.data.resize(grown, 0);
            }
            let want = self.data.len() - self.len;
            match file.read_at(&mut self.data[self.len..], self.len as u64) {
                Ok(n) => {
                    self.len += n;
                    if n < want {
                        return if self.len > MAX_ATTR_BYTES {
                            Err(ProbeError::TooLarge {
                                path: path.to_owned(),
                                limit: MAX_ATTR_BYTES,
                            })
                        } else {
                            Ok(())
                        };
                    }
                }
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(ProbeError::read(path, e)),
            }
        }
    }

    /// The content as text without trailing newlines and NUL padding.
    fn text(&self, path: &Path) -> Result<&str, ProbeError> {
        let text = std::str::from_utf8(self.bytes())
            .map_err(|_| ProbeError::parse(path, "<non-UTF-8 bytes>", "UTF-8 text"))?;
        Ok(text.trim_end_matches(['\n', '\0']))
    }
}

/// Open `path` for bounded reading: `O_RDONLY | O_NONBLOCK | O_CLOEXEC` (opening a FIFO
/// this way never waits for a writer), then `fstat`: anything but a regular file is refused.
/// `Ok(None)` when it does not exist.
pub(crate) fn open_regular(path: &Path) -> Result<Option<File>, ProbeError> {
    let file = match open_shedding(|| {
        OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_NONBLOCK | libc::O_CLOEXEC)
            .open(path)
    }) {
        Ok(f) => f,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(ProbeError::read(path, e)),
    };
    let meta = file.metadata().map_err(|e| ProbeError::read(path, e))?;
    let kind = meta.file_type();
    if kind.is_file() {
        return Ok(Some(file));
    }
    let what = if kind.is_fifo() {
        "a FIFO"
    } else if kind.is_char_device() {
        "a character device"
    } else if kind.is_block_device() {
        "a block device"
    } else if kind.is_socket() {
        "a socket"
    } else if kind.is_dir() {
        "a directory"
    } else {
        "not a regular file"
    };
    Err(ProbeError::NotRegular {
        path: path.to_owned(),
        what,
    })
}

/// The first `limit` bytes of `file` (fewer if it is shorter), read from offset 0 with
/// `pread`s into a buffer that starts at `initial` bytes and doubles (binary files: a PCI
/// `config`, the mount table).
pub(crate) fn read_prefix(file: &File, initial: usize, limit: usize) -> io::Result<Vec<u8>> {
    let mut buf = vec![0u8; initial.clamp(1, limit.max(1))];
    let mut len = 0usize;
    loop {
        if len == buf.len() {
            if len >= limit {
                break;
            }
            buf.resize((len * 2).min(limit), 0);
        }
        match file.read_at(&mut buf[len..], len as u64) {
            Ok(0) => break,
            Ok(n) => len += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    buf.truncate(len);
    Ok(buf)
}

/// Read a whole small file once (open, bounded read, close).
pub(crate) fn read_once<'b>(
    path: &Path,
    buf: &'b mut AttrBuf,
) -> Result<Option<&'b str>, ProbeError> {
    let Some(file) = open_regular(path)? else {
        return Ok(None);
    };
    buf.fill(&file, path)?;
    buf.text(path).map(Some)
}

/// `std::fs::read_to_string` with the same bounds as every attribute read (regular files
/// only, opened without blocking, at most [`MAX_ATTR_BYTES`]); errors keep their
/// `io::ErrorKind` (`NotFound` for a missing file) and name the path.
pub(crate) fn read_to_string(path: &Path) -> io::Result<String> {
    let mut buf = AttrBuf::new();
    let file = match open_regular(path) {
        Ok(Some(f)) => f,
        Ok(None) => return Err(io::Error::from_raw_os_error(libc::ENOENT)),
        Err(ProbeError::Read { source, .. }) => return Err(source),
        Err(e) => return Err(io::Error::new(io::ErrorKind::InvalidData, e.to_string())),
    };
    buf.fill(&file, path)
        .map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e.to_string()))?;
    String::from_utf8(buf.bytes().to_vec()).map_err(|_| {
        io::Error::new(
            io::ErrorKind::InvalidData,
            "stream did not contain valid UTF-8",
        )
    })
}

/// `fs::canonicalize(path)`, remembered per path while `path`'s own link target (one
/// `readlink`; none for a directory) is unchanged and the result still exists (one `stat`).
/// Canonicalizing walks every component with a `readlink` each, and the GPUDirect probe's
/// scan of the PCI bus resolves every GPU's link again (on every probe at the default
/// `rdma.counters_interval`: agent CPU). A re-created device's link points
/// elsewhere, so it is resolved again.
pub(crate) fn canonical_cached(path: &Path) -> io::Result<PathBuf> {
    use std::collections::HashMap;
    type Resolved = (Option<PathBuf>, PathBuf);
    static CACHE: std::sync::Mutex<Option<HashMap<PathBuf, Resolved>>> =
        std::sync::Mutex::new(None);
    /// Bound on remembered paths (a node has tens of devices and interfaces).
    const MAX_ENTRIES: usize = 4096;
    let link = fs::read_link(path).ok();
    {
        let cache = CACHE
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if let Some((target, canonical)) = cache.as_ref().and_then(|c| c.get(path))
            && *target == link
            && fs::symlink_metadata(canonical).is_ok()
        {
            return Ok(canonical.clone());
        }
    }
    let canonical = fs::canonicalize(path)?;
    let mut cache = CACHE
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    let map = cache.get_or_insert_with(HashMap::new);
    if map.len() >= MAX_ENTRIES {
        map.clear();
    }
    map.insert(path.to_owned(), (link, canonical.clone()));
    Ok(canonical)
}

/// The open failed because this process (EMFILE) or the system (ENFILE) is out of descriptors.
fn out_of_descriptors(e: &io::Error) -> bool {
    matches!(e.raw_os_error(), Some(libc::EMFILE | libc::ENFILE))
}

/// `open()`, and once more after closing some kept attribute files when it found the
/// descriptor table full: that is the agent's trouble, not the file's.
fn open_shedding<T>(open: impl Fn() -> io::Result<T>) -> io::Result<T> {
    open().or_else(|e| {
        if out_of_descriptors(&e) && kept_files::shed() {
            open()
        } else {
            Err(e)
        }
    })
}

/// One attribute file, kept open between probes within [`kept_files::budget`].
#[derive(Debug)]
pub(crate) struct Attr {
    path: PathBuf,
    slot: Slot,
}

#[derive(Debug)]
enum Slot {
    /// Kept open in [`kept_files`] (read by opening again if it was shed since).
    Open(Kept),
    /// Over the budget: opened, read and closed on every read.
    Reopen,
    Missing,
    /// Opening failed (not a regular file, EACCES, ...): the message, repeated every read
    /// until the directory changes and the attribute is opened again.
    Failed(String),
}

impl Attr {
    pub(crate) fn open(path: PathBuf) -> Self {
        Self::open_within(path, kept_files::budget())
    }

    /// [`Attr::open`] with an explicit budget of kept-open files.
    fn open_within(path: PathBuf, budget: usize) -> Self {
        let slot = match open_regular(&path) {
            Ok(Some(f)) => kept_files::keep(f, budget).map_or(Slot::Reopen, Slot::Open),
            Ok(None) => Slot::Missing,
            // Still out of descriptors after shedding: try again at each read, which needs
            // one descriptor for a moment, rather than remember a failure of the agent's.
            Err(ProbeError::Read { source, .. }) if out_of_descriptors(&source) => Slot::Reopen,
            Err(e) => Slot::Failed(e.to_string()),
        };
        Self { path, slot }
    }

    pub(crate) fn path(&self) -> &Path {
        &self.path
    }

    /// One `pread` at offset 0 (more only for content over 8 KiB). `Ok(None)` when the file
    /// did not exist when it was opened.
    pub(crate) fn read<'b>(&self, buf: &'b mut AttrBuf) -> Result<Option<&'b str>, AttrError<'_>> {
        if let Slot::Failed(msg) = &self.slot {
            return Err(AttrError::Message(msg));
        }
        if self.fill(buf).map_err(AttrError::Probe)? {
            buf.text(&self.path).map(Some).map_err(AttrError::Probe)
        } else {
            Ok(None)
        }
    }

    /// Read the content into `buf`; `false` when the file is missing (or failed to open: the
    /// callers report that from the slot).
    fn fill(&self, buf: &mut AttrBuf) -> Result<bool, ProbeError> {
        match &self.slot {
            Slot::Missing | Slot::Failed(_) => Ok(false),
            Slot::Open(kept) => match kept.file() {
                Some(file) => buf.fill(&file, &self.path).map(|()| true),
                None => self.fill_reopened(buf),
            },
            Slot::Reopen => self.fill_reopened(buf),
        }
    }
}

impl Attr {
    fn fill_reopened(&self, buf: &mut AttrBuf) -> Result<bool, ProbeError> {
        match open_regular(&self.path)? {
            Some(file) => buf.fill(&file, &self.path).map(|()| true),
            None => Ok(false),
        }
    }
}

/// A file read on every probe that may come and go (a netdev's counters, a module's
/// `initstate`, `/proc/modules`): kept open while it exists, looked up again on each read
/// while it does not (or could not be opened), and re-opened at once when a read says it is
/// gone (its device was re-created under the same name).
#[derive(Debug)]
pub(crate) struct KeptAttr(Attr);

impl KeptAttr {
    pub(crate) fn open(path: PathBuf) -> Self {
        Self(Attr::open(path))
    }

    fn reopen(&mut self) {
        self.0 = Attr::open(std::mem::take(&mut self.0.path));
    }

    /// [`Attr::read`], after looking the file up again if it was absent or unopenable.
    pub(crate) fn read<'b>(
        &mut self,
        buf: &'b mut AttrBuf,
    ) -> Result<Option<&'b str>, AttrError<'_>> {
        self.read_naming(buf).0
    }

    /// [`KeptAttr::read`], with the path for a message about what was read.
    fn read_naming<'b>(
        &mut self,
        buf: &'b mut AttrBuf,
    ) -> (Result<Option<&'b str>, AttrError<'_>>, &Path) {
        if matches!(self.0.slot, Slot::Missing | Slot::Failed(_)) {
            self.reopen();
        }
        let present = match self.0.fill(buf) {
            Err(e) if is_gone(&e) => {
                self.reopen();
                self.0.fill(buf)
            }
            other => other,
        };
        let attr = &self.0;
        let result = match (&attr.slot, present) {
            (Slot::Failed(msg), _) => Err(AttrError::Message(msg)),
            (_, Err(e)) => Err(AttrError::Probe(e)),
            (_, Ok(false)) => Ok(None),
            (_, Ok(true)) => buf.text(&attr.path).map(Some).map_err(AttrError::Probe),
        };
        (result, &attr.path)
    }

    /// Read and parse: absence is `None`, failures go to `errors` (naming the path).
    pub(crate) fn parsed<T>(
        &mut self,
        buf: &mut AttrBuf,
        expected: &'static str,
        errors: &mut Vec<String>,
        parse: impl FnOnce(&str) -> Option<T>,
    ) -> Option<T> {
        let (result, path) = self.read_naming(buf);
        parsed(result, path, expected, errors, parse)
    }

    /// An empty attribute is absent, not an error.
    pub(crate) fn string(&mut self, buf: &mut AttrBuf, errors: &mut Vec<String>) -> Option<String> {
        let (result, path) = self.read_naming(buf);
        string(result, path, errors)
    }
}

/// Why an [`Attr`] could not be read.
pub(crate) enum AttrError<'a> {
    /// Opening failed earlier; the stored message.
    Message(&'a str),
    Probe(ProbeError),
}

impl AttrError<'_> {
    /// The file (or its device) is gone: re-open the device's files on the next probe.
    pub(crate) fn is_gone(&self) -> bool {
        match self {
            Self::Probe(e) => is_gone(e),
            Self::Message(_) => false,
        }
    }
}

/// A read failed because the file (or its device) is gone.
fn is_gone(e: &ProbeError) -> bool {
    match e {
        ProbeError::Read { source, .. } => matches!(
            source.raw_os_error(),
            Some(libc::ENODEV | libc::ENOENT | libc::ESTALE | libc::ENXIO)
        ),
        _ => false,
    }
}

impl std::fmt::Display for AttrError<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Message(m) => f.write_str(m),
            Self::Probe(e) => e.fmt(f),
        }
    }
}

/// Turn a read result into a parsed value: absence is `None`, failures go to `errors` (the
/// message names the path).
pub(crate) fn parsed<T>(
    result: Result<Option<&str>, AttrError<'_>>,
    path: &Path,
    expected: &'static str,
    errors: &mut Vec<String>,
    parse: impl FnOnce(&str) -> Option<T>,
) -> Option<T> {
    match result {
        Ok(None) => None,
        Ok(Some(text)) => match parse(text) {
            Some(v) => Some(v),
            None => {
                errors.push(ProbeError::parse(path, text, expected).to_string());
                None
            }
        },
        Err(e) => {
            errors.push(e.to_string());
            None
        }
    }
}

/// An empty attribute is absent, not an error: rxe prints an empty `fw_ver` line.
pub(crate) fn string(
    result: Result<Option<&str>, AttrError<'_>>,
    path: &Path,
    errors: &mut Vec<String>,
) -> Option<String> {
    parsed(result, path, "text", errors, |s| Some(s.trim().to_owned())).filter(|s| !s.is_empty())
}

/// Reads small attribute files by path with one reusable buffer (open, one read, close), for
/// files read once rather than on every probe.
pub(crate) struct AttrReader {
    buf: AttrBuf,
}

impl AttrReader {
    pub(crate) fn new() -> Self {
        Self {
            buf: AttrBuf::new(),
        }
    }

    /// Read an optional attribute and parse it; absence is `None`, failure goes to `errors`.
    pub(crate) fn parsed<T>(
        &mut self,
        path: &Path,
        expected: &'static str,
        errors: &mut Vec<String>,
        parse: impl FnOnce(&str) -> Option<T>,
    ) -> Option<T> {
        let result = read_once(path, &mut self.buf).map_err(AttrError::Probe);
        parsed(result, path, expected, errors, parse)
    }

    /// One bounded read of `path` (a regular file, capped): `Ok(None)` when it is absent.
    pub(crate) fn read(&mut self, path: &Path) -> Result<Option<&str>, ProbeError> {
        read_once(path, &mut self.buf)
    }

    /// An empty attribute is absent, not an error.
    #[cfg(test)]
    pub(crate) fn string(&mut self, path: &Path, errors: &mut Vec<String>) -> Option<String> {
        let result = read_once(path, &mut self.buf).map_err(AttrError::Probe);
        string(result, path, errors)
    }
}

/// Entries of a directory.
pub(crate) struct Listing {
    /// UTF-8 names, sorted.
    pub names: Vec<String>,
    /// Names that are not UTF-8 (reported by the caller, never dropped silently).
    pub undecodable: Vec<OsString>,
}

/// Entries of a directory, sorted; `Ok(None)` when it does not exist.
///
/// `getdents64` into a buffer on the stack: `std::fs::read_dir` allocates 32 KiB per listing
/// (glibc's `opendir`) and a name per entry, and that large allocation made the allocator
/// consolidate the probe's freed small blocks on every listing.
pub(crate) fn list_dir(path: &Path) -> Result<Option<Listing>, ProbeError> {
    use rustix::fs::{Mode, OFlags, RawDir};
    use std::os::unix::ffi::OsStrExt;
    let failed = |e: rustix::io::Errno| ProbeError::ReadDir {
        path: path.to_owned(),
        source: e.into(),
    };
    let flags = OFlags::RDONLY | OFlags::DIRECTORY | OFlags::CLOEXEC;
    let fd = match open_shedding(|| {
        rustix::fs::open(path, flags, Mode::empty()).map_err(io::Error::from)
    }) {
        Ok(fd) => fd,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
        Err(source) => {
            return Err(ProbeError::ReadDir {
                path: path.to_owned(),
                source,
            });
        }
    };
    let mut buf = [std::mem::MaybeUninit::<u8>::uninit(); 8192];
    let mut entries = RawDir::new(fd, &mut buf);
    let mut names = Vec::new();
    let mut undecodable = Vec::new();
    while let Some(entry) = entries.next() {
        let entry = entry.map_err(failed)?;
        let name = entry.file_name().to_bytes();
        if name == b"." || name == b".." {
            continue;
        }
        match std::str::from_utf8(name) {
            Ok(name) => names.push(name.to_owned()),
            Err(_) => undecodable.push(std::ffi::OsStr::from_bytes(name).to_owned()),
        }
    }
    names.sort();
    undecodable.sort();
    Ok(Some(Listing { names, undecodable }))
}

/// What identifies one version of a directory: its inode (a re-created sysfs device gets a
/// new one) and its change times (a file added to or removed from a fixture directory).
/// `None` when the directory is absent or unreadable.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct DirStamp {
    dev: u64,
    ino: u64,
    mtime: (i64, i64),
    ctime: (i64, i64),
}

impl DirStamp {
    /// `stat` (following symlinks) of `path`.
    pub(crate) fn of(path: &Path) -> Option<Self> {
        let m = fs::metadata(path).ok()?;
        Some(Self {
            dev: m.dev(),
            ino: m.ino(),
            mtime: (m.mtime(), m.mtime_nsec()),
            ctime: (m.ctime(), m.ctime_nsec()),
        })
    }
}

#[cfg(test)]
mod tests {

    /// More attributes than the budget: every one reads, and no more than the budget stay open.
    #[test]
    fn attributes_past_the_kept_open_budget_are_read_by_reopening() {
        let dir = tempfile::tempdir().unwrap();
        let budget = 64;
        let attrs: Vec<Attr> = (0..budget + 20)
            .map(|i| {
                let path = dir.path().join(format!("a{i}"));
                std::fs::write(&path, format!("{i}\n")).unwrap();
                Attr::open_within(path, budget)
            })
            .collect();
        let kept = attrs
            .iter()
            .filter(|a| matches!(a.slot, Slot::Open(_)))
            .count();
        assert!(kept <= budget, "{kept} kept open, budget {budget}");
        assert!(attrs.iter().any(|a| matches!(a.slot, Slot::Reopen)));
        let mut buf = AttrBuf::new();
        for (i, a) in attrs.iter().enumerate() {
            let text = a.read(&mut buf).ok().flatten().map(|t| t.trim().to_owned());
            assert_eq!(text, Some(i.to_string()));
        }
    }

    use super::*;

    /// A remembered resolution follows a re-pointed link and forgets a vanished target.
    #[test]
    fn cached_canonical_paths_follow_relinks_and_removals() {
        let dir = tempfile::tempdir().unwrap();
        let (a, b) = (dir.path().join("a"), dir.path().join("b"));
        std::fs::create_dir(&a).unwrap();
        std::fs::create_dir(&b).unwrap();
        let link = dir.path().join("device");
        std::os::unix::fs::symlink("a", &link).unwrap();
        let real = |p: &Path| std::fs::canonicalize(p).unwrap();
        assert_eq!(canonical_cached(&link).unwrap(), real(&a));
        assert_eq!(canonical_cached(&link).unwrap(), real(&a));
        std::fs::remove_file(&link).unwrap();
        std::os::unix::fs::symlink("b", &link).unwrap();
        assert_eq!(canonical_cached(&link).unwrap(), real(&b));
        std::fs::remove_dir(&b).unwrap();
        assert!(canonical_cached(&link).is_err(), "a dangling link resolves");
        assert_eq!(canonical_cached(dir.path()).unwrap(), real(dir.path()));
    }

    #[test]
    fn reads_small_and_large_regular_files_and_caps_the_size() {
        let dir = tempfile::tempdir().unwrap();
        let mut buf = AttrBuf::new();
        let small = dir.path().join("small");
        fs::write(&small, "4: ACTIVE\n\0").unwrap();
        assert_eq!(read_once(&small, &mut buf).unwrap(), Some("4: ACTIVE"));
        let big = dir.path().join("big");
        fs::write(&big, vec![b'9'; 20_000]).unwrap();
        assert_eq!(
            read_once(&big, &mut buf).unwrap().map(str::len),
            Some(20_000)
        );
        let exact = dir.path().join("exact");
        fs::write(&exact, vec![b'1'; FIRST_READ]).unwrap();
        assert_eq!(
            read_once(&exact, &mut buf).unwrap().map(str::len),
            Some(FIRST_READ)
        );
        let huge = dir.path().join("huge");
        fs::write(&huge, vec![b'9'; MAX_ATTR_BYTES + 1]).unwrap();
        let e = read_once(&huge, &mut buf).unwrap_err().to_string();
        assert!(e.contains("huge") && e.contains("65536"), "{e}");
        assert_eq!(read_once(&dir.path().join("none"), &mut buf).unwrap(), None);
    }

    #[test]
    fn fifo_and_char_devices_are_refused_without_blocking() {
        let dir = tempfile::tempdir().unwrap();
        let fifo = dir.path().join("rate");
        let made = std::process::Command::new("mkfifo").arg(&fifo).status();
        assert!(made.is_ok_and(|s| s.success()), "mkfifo {}", fifo.display());
        let mut buf = AttrBuf::new();
        let e = read_once(&fifo, &mut buf).unwrap_err().to_string();
        assert!(e.contains("FIFO") && e.contains("rate"), "{e}");
        let zero = dir.path().join("zero");
        std::os::unix::fs::symlink("/dev/zero", &zero).unwrap();
        let e = read_once(&zero, &mut buf).unwrap_err().to_string();
        assert!(e.contains("character device") && e.contains("zero"), "{e}");
        let attr = Attr::open(zero);
        assert!(attr.read(&mut buf).is_err());
    }

    #[test]
    fn an_open_attribute_sees_rewrites_in_place() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("state");
        fs::write(&path, "1: DOWN\n").unwrap();
        let attr = Attr::open(path.clone());
        let mut buf = AttrBuf::new();
        assert_eq!(attr.read(&mut buf).ok().flatten(), Some("1: DOWN"));
        fs::write(&path, "4: ACTIVE\n").unwrap();
        assert_eq!(attr.read(&mut buf).ok().flatten(), Some("4: ACTIVE"));
        let missing = Attr::open(dir.path().join("nope"));
        assert_eq!(missing.read(&mut buf).ok().flatten(), None);
    }
}
