//! Reading sysfs-style attribute files and directories: the I/O every probe shares, so each
//! treats absence (`None`), read errors and malformed content the same way.

use crate::error::ProbeError;
use std::fs::{self, File};
use std::io::{self, Read};
use std::path::Path;

/// Reads small attribute files with one reusable buffer: sysfs attributes fit one page and
/// come back in one `read`, and the probe reads thousands of them per tick.
pub(crate) struct AttrReader {
    buf: Vec<u8>,
}

impl AttrReader {
    pub(crate) fn new() -> Self {
        Self {
            buf: Vec::with_capacity(4096),
        }
    }

    /// `Ok(None)` when the file does not exist; read errors (EINVAL on unused GID entries,
    /// EACCES, EIO) are returned so the caller decides what they mean.
    pub(crate) fn read(&mut self, path: &Path) -> Result<Option<&str>, ProbeError> {
        self.buf.clear();
        let mut file = match File::open(path) {
            Ok(f) => f,
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
            Err(e) => return Err(ProbeError::read(path, e)),
        };
        read_small(&mut file, &mut self.buf).map_err(|e| ProbeError::read(path, e))?;
        let text = std::str::from_utf8(&self.buf)
            .map_err(|_| ProbeError::parse(path, "<non-UTF-8 bytes>", "UTF-8 text"))?;
        Ok(Some(text.trim_end_matches(['\n', '\0'])))
    }

    /// Read an optional attribute and parse it; absence is `None`, failure goes to `errors`.
    pub(crate) fn parsed<T>(
        &mut self,
        path: &Path,
        expected: &'static str,
        errors: &mut Vec<String>,
        parse: impl FnOnce(&str) -> Option<T>,
    ) -> Option<T> {
        match self.read(path) {
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
    pub(crate) fn string(&mut self, path: &Path, errors: &mut Vec<String>) -> Option<String> {
        self.parsed(path, "text", errors, |s| Some(s.trim().to_owned()))
            .filter(|s| !s.is_empty())
    }
}

/// Read a whole small file with as few syscalls as possible: `read_to_end` also stats and
/// seeks to size its buffer, doubling the cost per attribute. A sysfs attribute (at most one
/// page) and a small regular file both come back in one `read`; a read that does not fill
/// the buffer is the end of the file for both.
fn read_small(file: &mut File, buf: &mut Vec<u8>) -> io::Result<()> {
    const CHUNK: usize = 4096;
    loop {
        let len = buf.len();
        buf.resize(len + CHUNK, 0);
        let n = match file.read(&mut buf[len..]) {
            Ok(n) => n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {
                buf.truncate(len);
                continue;
            }
            Err(e) => {
                buf.truncate(len);
                return Err(e);
            }
        };
        buf.truncate(len + n);
        if n < CHUNK {
            return Ok(());
        }
    }
}

/// Entries of a directory, sorted; `Ok(None)` when it does not exist.
pub(crate) fn list_dir(path: &Path) -> Result<Option<Vec<String>>, ProbeError> {
    let entries = match fs::read_dir(path) {
        Ok(e) => e,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
        Err(source) => {
            return Err(ProbeError::ReadDir {
                path: path.to_owned(),
                source,
            });
        }
    };
    let mut names = Vec::new();
    for entry in entries {
        let entry = entry.map_err(|source| ProbeError::ReadDir {
            path: path.to_owned(),
            source,
        })?;
        if let Some(name) = entry.file_name().to_str() {
            names.push(name.to_owned());
        }
    }
    names.sort();
    Ok(Some(names))
}
