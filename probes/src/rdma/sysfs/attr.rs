//! Reading one attribute of an open device or port: what a failure does to the report (an
//! error naming the path, or nothing) and to the handles (re-open when the file is gone).

use crate::sysfs_io::{Attr, AttrBuf, parsed, string};
use std::path::PathBuf;

/// A handle that reads as absent, until the device is opened.
pub(super) fn placeholder() -> Attr {
    Attr::open(PathBuf::new())
}

/// Read and parse an attribute: absence is `None`, failures go to `errors` (naming the path),
/// and a file that is gone marks the device for re-opening.
pub(super) fn get<T>(
    attr: &Attr,
    buf: &mut AttrBuf,
    expected: &'static str,
    errors: &mut Vec<String>,
    gone: &mut bool,
    parse: impl FnOnce(&str) -> Option<T>,
) -> Option<T> {
    let result = attr.read(buf);
    if let Err(e) = &result {
        *gone |= e.is_gone();
    }
    parsed(result, attr.path(), expected, errors, parse)
}

pub(super) fn text(
    attr: &Attr,
    buf: &mut AttrBuf,
    errors: &mut Vec<String>,
    gone: &mut bool,
) -> Option<String> {
    let result = attr.read(buf);
    if let Err(e) = &result {
        *gone |= e.is_gone();
    }
    string(result, attr.path(), errors)
}

/// Read and parse an attribute whose failures are not errors (the kernel answers EINVAL for
/// GID attributes of entries without a netdev, `Unknown` for the speed of a link that is down).
pub(super) fn quiet<T>(
    attr: &Attr,
    buf: &mut AttrBuf,
    parse: impl FnOnce(&str) -> Option<T>,
) -> Option<T> {
    attr.read(buf).ok().flatten().and_then(parse)
}
