//! Reading the requirements file: bounded in size and nesting before the YAML parser sees it.

use crate::error::{Error, Result};
use std::path::Path;

/// Largest requirements file accepted.
pub const MAX_CONFIG_BYTES: usize = 256 * 1024;
/// Deepest nesting accepted (block indentation levels, `- ` items and flow brackets).
pub const MAX_CONFIG_DEPTH: usize = 32;

/// Read the requirements file without ever blocking on it: it must be a regular file (a FIFO,
/// a directory or `/dev/zero` is refused before a byte is read) of at most
/// [`MAX_CONFIG_BYTES`].
pub(super) fn read_config_file(path: &Path) -> Result<String> {
    use std::io::Read;
    use std::os::unix::fs::OpenOptionsExt;
    let read_err = |source: std::io::Error| Error::ConfigRead {
        path: path.to_owned(),
        source,
    };
    let not_regular = |what: &str| Error::ConfigParse {
        path: path.to_owned(),
        message: format!("is {what}, not a regular file; give the path of a YAML file"),
    };
    // O_NONBLOCK: opening a FIFO without a writer returns at once instead of waiting.
    let file = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK)
        .open(path)
        .map_err(read_err)?;
    let meta = file.metadata().map_err(read_err)?;
    let ft = meta.file_type();
    if !ft.is_file() {
        use std::os::unix::fs::FileTypeExt;
        let what = if ft.is_dir() {
            "a directory"
        } else if ft.is_fifo() {
            "a FIFO"
        } else if ft.is_char_device() || ft.is_block_device() {
            "a device"
        } else if ft.is_socket() {
            "a socket"
        } else {
            "not a regular file"
        };
        return Err(not_regular(what));
    }
    let limit = u64::try_from(MAX_CONFIG_BYTES).unwrap_or(u64::MAX);
    if meta.len() > limit {
        return Err(Error::ConfigParse {
            path: path.to_owned(),
            message: format!(
                "{} bytes is more than the {MAX_CONFIG_BYTES} a requirements file may have",
                meta.len()
            ),
        });
    }
    let mut bytes = Vec::new();
    file.take(limit + 1)
        .read_to_end(&mut bytes)
        .map_err(read_err)?;
    if bytes.len() > MAX_CONFIG_BYTES {
        return Err(Error::ConfigParse {
            path: path.to_owned(),
            message: format!("more than the {MAX_CONFIG_BYTES} bytes a requirements file may have"),
        });
    }
    String::from_utf8(bytes).map_err(|e| Error::ConfigParse {
        path: path.to_owned(),
        message: format!("not UTF-8 text (byte {})", e.utf8_error().valid_up_to()),
    })
}

/// An upper estimate of how deeply `text` nests: block indentation levels plus `- ` sequence
/// markers plus open flow brackets outside quotes. Linear, so deep nesting is refused before
/// the YAML parser spends time on it.
pub fn nesting_depth(text: &str) -> usize {
    let mut max = 0usize;
    let mut indents: Vec<usize> = Vec::new();
    let mut flow = 0usize;
    let (mut single, mut double) = (false, false);
    for line in text.lines() {
        let trimmed = line.trim_start_matches([' ', '\t']);
        if trimmed.is_empty() || (trimmed.starts_with('#') && !single && !double) {
            continue;
        }
        if flow == 0 && !single && !double {
            let indent = line.len() - trimmed.len();
            while indents.last().is_some_and(|&i| i >= indent) {
                indents.pop();
            }
            indents.push(indent);
        }
        let mut rest = trimmed;
        let mut dashes = 0usize;
        if !single && !double {
            while let Some(r) = rest.strip_prefix('-') {
                if !(r.is_empty() || r.starts_with([' ', '\t'])) {
                    break;
                }
                dashes += 1;
                rest = r.trim_start_matches([' ', '\t']);
            }
        }
        let mut peak = flow;
        let mut escaped = false;
        // Quotes open a scalar only where one can start (`it's` is no quote).
        let mut prev_sep = true;
        let mut prev_space = true;
        for c in rest.chars() {
            if double {
                match c {
                    _ if escaped => escaped = false,
                    '\\' => escaped = true,
                    '"' => double = false,
                    _ => {}
                }
                continue;
            }
            if single {
                if c == '\'' {
                    single = false;
                }
                continue;
            }
            match c {
                '"' if prev_sep => double = true,
                '\'' if prev_sep => single = true,
                '#' if prev_space => break,
                '[' | '{' => {
                    flow += 1;
                    peak = peak.max(flow);
                }
                ']' | '}' => flow = flow.saturating_sub(1),
                _ => {}
            }
            prev_space = c == ' ' || c == '\t';
            prev_sep = prev_space || matches!(c, '[' | '{' | ',');
        }
        max = max.max(indents.len() + dashes + peak);
    }
    max
}
