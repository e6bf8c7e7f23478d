//! `strftime` for chat templates' `strftime_now`, in UTC, through chrono's calendar.

use std::fmt::Write;
use std::time::{SystemTime, UNIX_EPOCH};

use chrono::format::StrftimeItems;
use chrono::DateTime;
use minijinja::{Error as JinjaError, ErrorKind};

pub(super) fn now_unix() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| i64::try_from(d.as_secs()).unwrap_or(i64::MAX))
}

/// transformers' `strftime_now` is `datetime.now().strftime(fmt)`. Without a time-zone database
/// this uses UTC, which equals local time on the machines this runs on (TZ unset / Etc/UTC).
/// chrono's directives are C's (in the C locale) plus glibc's `%-d` style unpadded forms.
pub(super) fn strftime_utc(format: &str, unix: i64) -> Result<String, JinjaError> {
    let error = |why: String| JinjaError::new(ErrorKind::InvalidOperation, why);
    let items = StrftimeItems::new(format)
        .parse()
        .map_err(|_| error(format!("strftime_now: unsupported directive in {format:?}")))?;
    let time = DateTime::from_timestamp(unix, 0)
        .ok_or_else(|| error(format!("strftime_now: the time {unix} is out of range")))?;
    let mut out = String::new();
    write!(out, "{}", time.format_with_items(items.iter()))
        .map_err(|_| error(format!("strftime_now: {format:?} cannot format a UTC time")))?;
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::strftime_utc;

    /// Every directive the templates may use, on instants whose calendar fields were computed
    /// independently (GNU `date -u -d @EPOCH`): the epoch, a leap day, the first second past
    /// 32-bit time, the end of a century's last year, and an afternoon.
    #[test]
    fn fixed_instants_format_as_the_calendar_says() {
        let format = "%Y-%m-%d %H:%M:%S|%a %A %b %h %B|%e|%j %w|%I %p|%y|%F %T|%-d %-m %-H|%%";
        let cases = [
            (
                0,
                "1970-01-01 00:00:00|Thu Thursday Jan Jan January| 1|001 4|12 AM|70|\
                 1970-01-01 00:00:00|1 1 0|%",
            ),
            (
                951_782_400,
                "2000-02-29 00:00:00|Tue Tuesday Feb Feb February|29|060 2|12 AM|00|\
                 2000-02-29 00:00:00|29 2 0|%",
            ),
            (
                951_825_599,
                "2000-02-29 11:59:59|Tue Tuesday Feb Feb February|29|060 2|11 AM|00|\
                 2000-02-29 11:59:59|29 2 11|%",
            ),
            (
                2_147_483_648,
                "2038-01-19 03:14:08|Tue Tuesday Jan Jan January|19|019 2|03 AM|38|\
                 2038-01-19 03:14:08|19 1 3|%",
            ),
            (
                4_102_444_799,
                "2099-12-31 23:59:59|Thu Thursday Dec Dec December|31|365 4|11 PM|99|\
                 2099-12-31 23:59:59|31 12 23|%",
            ),
            (
                1_700_000_000,
                "2023-11-14 22:13:20|Tue Tuesday Nov Nov November|14|318 2|10 PM|23|\
                 2023-11-14 22:13:20|14 11 22|%",
            ),
        ];
        for (unix, want) in cases {
            assert_eq!(strftime_utc(format, unix).unwrap(), want, "at {unix}");
        }
    }

    #[test]
    fn an_unknown_directive_is_an_error_naming_it() {
        for format in ["%Q", "date %"] {
            let e = strftime_utc(format, 0).unwrap_err();
            assert!(e.to_string().contains("strftime_now"), "{format}: {e}");
        }
    }
}
