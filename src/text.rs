//! Text cut to the API's and the kubelet's size limits (an Event's `note` 1 kB, a condition's
//! message 32 kB, a termination log 4 kB), always on a character boundary; and the columns
//! of the commands' tables.

/// The longest prefix of `s` of at most `max` bytes that ends on a character boundary.
pub fn truncate(s: &str, max: usize) -> String {
    s[..boundary(s, max)].to_owned()
}

/// `s` as is when it fits in `max` bytes, else its prefix followed by ` ...`, all within
/// `max` bytes, so that a reader sees the text was cut.
pub fn truncate_marked(s: &str, max: usize) -> String {
    const MARK: &str = " ...";
    if s.len() <= max {
        return s.to_owned();
    }
    if max < MARK.len() {
        return truncate(s, max);
    }
    format!(
        "{}{MARK}",
        &s[..boundary(s, max.saturating_sub(MARK.len()))]
    )
}

/// The largest character boundary of `s` at or below `max`.
fn boundary(s: &str, max: usize) -> usize {
    if s.len() <= max {
        return s.len();
    }
    let mut end = max;
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    end
}

/// `header` and `rows` as left-aligned columns two spaces apart, each line indented by two.
pub fn write_columns(out: &mut String, header: &[&str], rows: Vec<Vec<String>>) {
    let widths: Vec<usize> = (0..header.len())
        .map(|c| {
            rows.iter()
                .filter_map(|r| r.get(c))
                .map(|cell| cell.chars().count())
                .chain([header[c].chars().count()])
                .max()
                .unwrap_or(0)
        })
        .collect();
    let header: Vec<String> = header.iter().map(|h| (*h).to_owned()).collect();
    for row in std::iter::once(header).chain(rows) {
        let line: Vec<String> = row
            .iter()
            .zip(&widths)
            .map(|(cell, w)| format!("{cell:<w$}"))
            .collect();
        out.push_str("  ");
        out.push_str(line.join("  ").trim_end());
        out.push('\n');
    }
}

/// 64-bit FNV-1a: a stable short name for a text too long for a label or object name.
pub fn fnv64(text: &str) -> u64 {
    text.bytes().fold(0xcbf2_9ce4_8422_2325_u64, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn text_that_fits_is_kept_whole() {
        assert_eq!(truncate("short", 10), "short");
        assert_eq!(truncate_marked("short", 5), "short");
    }

    #[test]
    fn a_cut_never_splits_a_character() {
        // "é" is two bytes: a cut at 2 would fall inside it.
        assert_eq!(truncate("aé", 2), "a");
        assert_eq!(truncate("aéb", 3), "aé");
        let cut = truncate_marked(&"é".repeat(100), 11);
        assert!(cut.len() <= 11, "{cut:?}");
        assert_eq!(cut, "ééé ...");
    }

    #[test]
    fn a_marked_cut_fits_its_limit() {
        let long = "x".repeat(5000);
        let cut = truncate_marked(&long, 4096);
        assert_eq!(cut.len(), 4096);
        assert!(cut.ends_with(" ..."));
        assert_eq!(truncate(&long, 1024).len(), 1024);
        // No room for the mark: a plain cut, still within the limit.
        assert_eq!(truncate_marked(&long, 2), "xx");
    }
}
