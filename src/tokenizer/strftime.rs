//! `strftime` for chat templates' `strftime_now`, in UTC, without a time-zone database.

use std::time::{SystemTime, UNIX_EPOCH};

use minijinja::{Error as JinjaError, ErrorKind};

pub(super) fn now_unix() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| i64::try_from(d.as_secs()).unwrap_or(i64::MAX))
}

/// transformers' `strftime_now` is `datetime.now().strftime(fmt)`. Without a time-zone database
/// this uses UTC, which equals local time on the machines this runs on (TZ unset / Etc/UTC).
/// Supports the C-locale directives chat templates use, plus glibc's `%-d` style unpadded forms.
pub(super) fn strftime_utc(format: &str, unix: i64) -> Result<String, JinjaError> {
    const DAYS: [&str; 7] = [
        "Sunday",
        "Monday",
        "Tuesday",
        "Wednesday",
        "Thursday",
        "Friday",
        "Saturday",
    ];
    const MONTHS: [&str; 12] = [
        "January",
        "February",
        "March",
        "April",
        "May",
        "June",
        "July",
        "August",
        "September",
        "October",
        "November",
        "December",
    ];
    let days = unix.div_euclid(86_400);
    let secs = unix.rem_euclid(86_400);
    let (year, month, day) = civil_from_days(days);
    let weekday = (days + 4).rem_euclid(7) as usize; // 1970-01-01 was a Thursday
    let yday = days - days_from_civil(year, 1, 1) + 1;
    let (hour, minute, second) = (secs / 3600, secs / 60 % 60, secs % 60);

    let mut out = String::new();
    let mut chars = format.chars();
    while let Some(c) = chars.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        let mut spec = chars.next();
        let unpadded = spec == Some('-');
        if unpadded {
            spec = chars.next();
        }
        let num = |n: i64, width: usize| {
            if unpadded {
                n.to_string()
            } else {
                format!("{n:0width$}")
            }
        };
        let piece = match spec {
            Some('a') => DAYS[weekday][..3].to_string(),
            Some('A') => DAYS[weekday].to_string(),
            Some('b') | Some('h') => MONTHS[month as usize - 1][..3].to_string(),
            Some('B') => MONTHS[month as usize - 1].to_string(),
            Some('d') => num(day, 2),
            Some('e') => format!("{day:2}"),
            Some('m') => num(month, 2),
            Some('y') => num(year.rem_euclid(100), 2),
            Some('Y') => year.to_string(),
            Some('H') => num(hour, 2),
            Some('I') => num((hour + 11) % 12 + 1, 2),
            Some('p') => if hour < 12 { "AM" } else { "PM" }.to_string(),
            Some('M') => num(minute, 2),
            Some('S') => num(second, 2),
            Some('j') => num(yday, 3),
            Some('w') => weekday.to_string(),
            Some('F') => format!("{year}-{month:02}-{day:02}"),
            Some('T') => format!("{hour:02}:{minute:02}:{second:02}"),
            Some('%') => "%".to_string(),
            other => {
                return Err(JinjaError::new(
                    ErrorKind::InvalidOperation,
                    format!(
                        "strftime_now: unsupported directive %{}",
                        other.map(String::from).unwrap_or_default()
                    ),
                ))
            }
        };
        out.push_str(&piece);
    }
    Ok(out)
}

/// Howard Hinnant's days-since-epoch to proleptic Gregorian (year, month, day).
fn civil_from_days(days: i64) -> (i64, i64, i64) {
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    (year, month, day)
}

fn days_from_civil(year: i64, month: i64, day: i64) -> i64 {
    let y = if month <= 2 { year - 1 } else { year };
    let era = y.div_euclid(400);
    let yoe = y.rem_euclid(400);
    let mp = if month > 2 { month - 3 } else { month + 9 };
    let doy = (153 * mp + 2) / 5 + day - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    era * 146_097 + doe - 719_468
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
