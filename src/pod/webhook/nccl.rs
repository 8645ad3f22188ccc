//! How NCCL reads the environment variables the webhook judges.
//!
//! Integer parameters (`NCCL_IB_DISABLE`, ...) go through NCCL's `ncclLoadParam`:
//! `strtoll(str, NULL, 0)` when the variable is set and not empty, the default (0) when
//! `strtoll` sets `errno` (an overflow). So leading white space is skipped, a sign and a `0x`
//! (hex) or `0` (octal) prefix are honoured, and parsing stops at the first character that is
//! not a digit: `1`, `2`, `0x1`, `  1`, `+1`, `-1` and `1abc` all disable IB; `true`, `yes`
//! and `on` read as 0 (IB stays on), and so does an overflowing number. `NCCL_NET` is
//! compared with each transport's name by `strcasecmp` (no trimming).

/// What `strtoll(s, NULL, 0)` makes of a value, as NCCL uses it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NcclInt {
    /// Empty: NCCL treats it as unset.
    Unset,
    /// The number NCCL uses; `whole` when the entire value was the number (nothing after
    /// it, and at least one digit).
    Value { value: i64, whole: bool },
    /// Out of range: NCCL uses the default.
    Overflow,
}

/// [`NcclInt`] of `s`.
pub fn nccl_int(s: &str) -> NcclInt {
    if s.is_empty() {
        return NcclInt::Unset;
    }
    let b = s.as_bytes();
    let mut i = 0;
    // isspace() in the C locale.
    while i < b.len() && matches!(b[i], b' ' | b'\t' | b'\n' | 0x0b | 0x0c | b'\r') {
        i += 1;
    }
    let mut negative = false;
    if i < b.len() && matches!(b[i], b'+' | b'-') {
        negative = b[i] == b'-';
        i += 1;
    }
    let radix: u32 = if b.get(i) == Some(&b'0')
        && matches!(b.get(i + 1), Some(b'x' | b'X'))
        && b.get(i + 2).is_some_and(u8::is_ascii_hexdigit)
    {
        i += 2;
        16
    } else if b.get(i) == Some(&b'0') {
        8
    } else {
        10
    };
    const LIMIT: u128 = 1 << 63;
    let start = i;
    let mut magnitude: u128 = 0;
    let mut overflow = false;
    while let Some(d) = b.get(i).and_then(|c| char::from(*c).to_digit(radix)) {
        magnitude = magnitude * u128::from(radix) + u128::from(d);
        // Past 2^63 nothing fits an int64_t: remember, and stop growing.
        if magnitude > LIMIT {
            overflow = true;
            magnitude = LIMIT + 1;
        }
        i += 1;
    }
    if i == start {
        // No digits: strtoll returns 0 and leaves errno alone.
        return NcclInt::Value {
            value: 0,
            whole: false,
        };
    }
    let magnitude = i128::try_from(magnitude).unwrap_or(i128::MAX);
    let value = i64::try_from(if negative { -magnitude } else { magnitude }).ok();
    match value {
        Some(value) if !overflow => NcclInt::Value {
            value,
            whole: i == b.len(),
        },
        _ => NcclInt::Overflow,
    }
}

/// Why a value of `NCCL_IB_DISABLE` is refused; `None`: NCCL reads it as 0 and it says so
/// plainly (empty, `0`, ` 0`, `0x0`, `-0`, `000`).
///
/// A value NCCL happens to read as 0 but that says something else (`true`, `yes`, `0abc`, an
/// overflowing number) is refused too: whoever wrote `NCCL_IB_DISABLE=true` meant to turn IB
/// off, and the pod would run on something other than what its author expects.
pub fn ib_disable_problem(value: &str) -> Option<String> {
    match nccl_int(value) {
        NcclInt::Unset
        | NcclInt::Value {
            value: 0,
            whole: true,
        } => None,
        NcclInt::Value { value: 0, .. } | NcclInt::Overflow => Some(format!(
            "NCCL_IB_DISABLE={value:?} (NCCL reads it as 0 but it asks for IB to be off)"
        )),
        NcclInt::Value { value: n, .. } => Some(format!(
            "NCCL_IB_DISABLE={value:?} (NCCL reads it as {n}: IB off, NCCL would use TCP \
             sockets)"
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_as_strtoll_base_0() {
        let v = |value, whole| NcclInt::Value { value, whole };
        for (s, want) in [
            ("", NcclInt::Unset),
            ("0", v(0, true)),
            ("1", v(1, true)),
            ("2", v(2, true)),
            ("0x1", v(1, true)),
            ("0X1f", v(31, true)),
            ("  1", v(1, true)),
            ("\t\n1", v(1, true)),
            ("+1", v(1, true)),
            ("-1", v(-1, true)),
            ("010", v(8, true)),
            ("08", v(0, false)),
            ("0x", v(0, false)),
            ("1abc", v(1, false)),
            ("1 ", v(1, false)),
            ("true", v(0, false)),
            ("-", v(0, false)),
            ("9223372036854775807", v(i64::MAX, true)),
            ("-9223372036854775808", v(i64::MIN, true)),
            ("9223372036854775808", NcclInt::Overflow),
            (
                "99999999999999999999999999999999999999999",
                NcclInt::Overflow,
            ),
        ] {
            assert_eq!(nccl_int(s), want, "{s:?}");
        }
    }

    #[test]
    fn ib_disable_is_refused_unless_plainly_zero() {
        for ok in ["", "0", " 0", "0x0", "-0", "000"] {
            assert_eq!(ib_disable_problem(ok), None, "{ok:?}");
        }
        for bad in [
            "1", "2", "0x1", "  1", "+1", "-1", "1abc", "true", "yes", "0abc",
        ] {
            let p = ib_disable_problem(bad).unwrap_or_default();
            assert!(p.starts_with("NCCL_IB_DISABLE="), "{bad:?}: {p}");
        }
        assert!(ib_disable_problem("2").unwrap().contains("reads it as 2"));
        assert!(
            ib_disable_problem("true")
                .unwrap()
                .contains("reads it as 0")
        );
    }
}
