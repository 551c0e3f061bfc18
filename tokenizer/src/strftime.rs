//! A small, dependency-free `strftime` over UTC for the chat templates' `strftime_now`
//! (Llama 3.x templates print "Today Date: 26 Jul 2024" with `%d %b %Y`).
//!
//! Supported: `%a %A %b %B %d %e %H %I %j %m %M %p %S %y %Y %F %T %Z %z %%`, each with
//! glibc's optional `-` flag (no padding, e.g. `%-d`). Unknown directives are copied
//! through unchanged.

const DAYS: [&str; 7] = ["Sunday", "Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday"];
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

/// Proleptic Gregorian date of `days` since 1970-01-01 (Howard Hinnant's algorithm).
fn civil_from_days(days: i64) -> (i64, u32, u32) {
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let m = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    let y = yoe + era * 400 + i64::from(m <= 2);
    (y, m, d)
}

fn is_leap(y: i64) -> bool {
    (y % 4 == 0 && y % 100 != 0) || y % 400 == 0
}

/// Formats `unix_secs` (UTC) like Python's `datetime.strftime(format)`.
pub fn format_utc(format: &str, unix_secs: i64) -> String {
    let days = unix_secs.div_euclid(86_400);
    let secs = unix_secs.rem_euclid(86_400);
    let (year, month, day) = civil_from_days(days);
    let (hour, minute, second) = (secs / 3600, (secs / 60) % 60, secs % 60);
    let weekday = (days + 4).rem_euclid(7) as usize; // 1970-01-01 was a Thursday.
    const CUMULATIVE: [u32; 12] = [0, 31, 59, 90, 120, 151, 181, 212, 243, 273, 304, 334];
    let yday = CUMULATIVE[month as usize - 1] + day + u32::from(month > 2 && is_leap(year));
    let hour12 = if hour % 12 == 0 { 12 } else { hour % 12 };

    let mut out = String::with_capacity(format.len() + 16);
    let mut chars = format.chars().peekable();
    while let Some(c) = chars.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        let no_pad = chars.peek() == Some(&'-');
        if no_pad {
            chars.next();
        }
        let num = |n: i64, width: usize| {
            if no_pad {
                n.to_string()
            } else {
                format!("{n:0width$}")
            }
        };
        let Some(d) = chars.next() else {
            out.push('%');
            break;
        };
        let piece = match d {
            'a' => DAYS[weekday][..3].to_owned(),
            'A' => DAYS[weekday].to_owned(),
            'b' | 'h' => MONTHS[month as usize - 1][..3].to_owned(),
            'B' => MONTHS[month as usize - 1].to_owned(),
            'd' => num(i64::from(day), 2),
            'e' => format!("{day:>2}"),
            'H' => num(hour, 2),
            'I' => num(hour12, 2),
            'j' => num(i64::from(yday), 3),
            'm' => num(i64::from(month), 2),
            'M' => num(minute, 2),
            'p' => (if hour < 12 { "AM" } else { "PM" }).to_owned(),
            'S' => num(second, 2),
            'y' => num(year.rem_euclid(100), 2),
            'Y' => year.to_string(),
            'F' => format!("{year}-{month:02}-{day:02}"),
            'T' => format!("{hour:02}:{minute:02}:{second:02}"),
            'Z' => "UTC".to_owned(),
            'z' => "+0000".to_owned(),
            '%' => "%".to_owned(),
            other => {
                out.push('%');
                if no_pad {
                    out.push('-');
                }
                out.push(other);
                continue;
            }
        };
        out.push_str(&piece);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Naive reference: walk day by day from the epoch.
    fn naive_date(days: i64) -> (i64, u32, u32) {
        let (mut y, mut m, mut d) = (1970i64, 1u32, 1u32);
        for _ in 0..days {
            let len = match m {
                2 if is_leap(y) => 29,
                2 => 28,
                4 | 6 | 9 | 11 => 30,
                _ => 31,
            };
            d += 1;
            if d > len {
                d = 1;
                m += 1;
                if m > 12 {
                    m = 1;
                    y += 1;
                }
            }
        }
        (y, m, d)
    }

    #[test]
    fn civil_matches_naive_walk() {
        for days in (0..40_000).step_by(7) {
            assert_eq!(civil_from_days(days), naive_date(days), "day {days}");
        }
    }

    #[test]
    fn known_dates() {
        assert_eq!(format_utc("%d %b %Y", 1_721_952_000), "26 Jul 2024");
        assert_eq!(
            format_utc("%A %B %-d %j %I:%M:%S %p %y %%", 1_709_251_199),
            "Thursday February 29 060 11:59:59 PM 24 %"
        );
        assert_eq!(format_utc("%F %T %Z %q", 0), "1970-01-01 00:00:00 UTC %q");
        assert_eq!(format_utc("%Y-%m-%d", -1), "1969-12-31");
    }
}
