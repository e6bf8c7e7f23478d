//! A minijinja environment that behaves like transformers' `ImmutableSandboxedEnvironment`:
//! Python's printing of values, its `tojson`, `raise_exception` and `strftime_now`, and the
//! `{% generation %}` tag.

use std::fmt;

use minijinja::syntax::SyntaxConfig;
use minijinja::value::{Kwargs, Rest, ValueKind};
use minijinja::{
    escape_formatter, AutoEscape, Environment, Error as JinjaError, ErrorKind, Output, State, Value,
};

use super::strftime::{now_unix, strftime_utc};

/// The error a template's `raise_exception(..)` call produces, kept as the source of the
/// render error so it can be told apart from engine errors.
#[derive(Debug)]
struct TemplateException(String);

impl fmt::Display for TemplateException {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for TemplateException {}

pub(super) fn raised_message(err: &JinjaError) -> Option<String> {
    let mut source = std::error::Error::source(err);
    while let Some(e) = source {
        if let Some(raised) = e.downcast_ref::<TemplateException>() {
            return Some(raised.0.clone());
        }
        source = e.source();
    }
    None
}

/// An environment that behaves like transformers' `ImmutableSandboxedEnvironment`: trim and
/// lstrip blocks, Python string methods, its `raise_exception`, `strftime_now` and `tojson`,
/// and Python's way of printing values.
pub(super) fn template_environment() -> Result<Environment<'static>, JinjaError> {
    let mut env = Environment::new();
    env.set_syntax(
        SyntaxConfig::builder()
            .trim_blocks(true)
            .lstrip_blocks(true)
            .build()?,
    );
    env.set_auto_escape_callback(|_| AutoEscape::None);
    env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
    env.set_formatter(python_formatter);
    env.add_filter("tojson", tojson);
    env.add_function(
        "raise_exception",
        |message: Value| -> Result<Value, JinjaError> {
            let message = message.to_string();
            Err(
                JinjaError::new(ErrorKind::InvalidOperation, message.clone())
                    .with_source(TemplateException(message)),
            )
        },
    );
    env.add_function("strftime_now", |format: String| {
        strftime_utc(&format, now_unix())
    });
    Ok(env)
}

/// transformers' `{% generation %}` blocks (an extension marking assistant text for training
/// masks) render their body unchanged when no mask is requested, which is exactly what
/// `{% if true %}` does; rewriting keeps the tags' whitespace control.
pub(super) fn rewrite_generation_tags(source: &str) -> String {
    let mut out = String::with_capacity(source.len());
    let mut rest = source;
    while let Some(start) = rest.find("{%") {
        let (before, tag) = rest.split_at(start);
        out.push_str(before);
        let body = &tag[2..];
        let marker_len = usize::from(body.starts_with(['-', '+']));
        let after_marker = &body[marker_len..];
        let word_start = after_marker.len() - after_marker.trim_start().len();
        let word_rest = &after_marker[word_start..];
        let replacement = [("endgeneration", "endif"), ("generation", "if true")]
            .into_iter()
            .find(|(word, _)| {
                word_rest.starts_with(word)
                    && word_rest[word.len()..].starts_with(|c: char| {
                        c.is_whitespace() || c == '-' || c == '+' || c == '%'
                    })
            });
        match replacement {
            Some((word, with)) => {
                let keep = 2 + marker_len + word_start;
                out.push_str(&tag[..keep]);
                out.push_str(with);
                rest = &tag[keep + word.len()..];
            }
            None => {
                out.push_str("{%");
                rest = &tag[2..];
            }
        }
    }
    out.push_str(rest);
    out
}

/// Prints `{{ value }}` the way Jinja2 does, with Python's `str()`. minijinja's own printing is
/// already Python-like (`True`, `None`, `['a', 1]`) except for floats, which Python writes in
/// shortest form with exponents from 1e16 and below 1e-4 (`1e-05`, not `0.00001`). Floats
/// nested in printed containers keep minijinja's form.
fn python_formatter(out: &mut Output, state: &mut State, value: &Value) -> Result<(), JinjaError> {
    if value.kind() == ValueKind::Number && !value.is_integer() {
        if let Ok(x) = f64::try_from(value.clone()) {
            return out.write_str(&py_float(x)).map_err(JinjaError::from);
        }
    }
    escape_formatter(out, state, value)
}

fn map_pairs(value: &Value) -> Vec<(Value, Value)> {
    value
        .try_iter()
        .map(|keys| {
            keys.map(|k| {
                let v = value.get_item(&k).unwrap_or_default();
                (k, v)
            })
            .collect()
        })
        .unwrap_or_default()
}

/// Python's `repr(float)`: shortest round-trip digits, positional for exponents -4..16,
/// otherwise scientific with a signed two-digit exponent (`1e+16`, `1.5e-05`).
fn py_float(x: f64) -> String {
    if x.is_nan() {
        return "nan".into();
    }
    if x.is_infinite() {
        return if x > 0.0 { "inf" } else { "-inf" }.into();
    }
    let sci = format!("{x:e}");
    let (mantissa, exponent) = sci.split_once('e').unwrap_or((&sci, "0"));
    let exponent: i32 = exponent.parse().unwrap_or(0);
    if (-4..16).contains(&exponent) {
        let sign = if mantissa.starts_with('-') { "-" } else { "" };
        let digits: String = mantissa.chars().filter(char::is_ascii_digit).collect();
        let point = exponent + 1;
        if point <= 0 {
            format!(
                "{sign}0.{}{digits}",
                "0".repeat(point.unsigned_abs() as usize)
            )
        } else if point as usize >= digits.len() {
            format!(
                "{sign}{digits}{}.0",
                "0".repeat(point as usize - digits.len())
            )
        } else {
            let (int, frac) = digits.split_at(point as usize);
            format!("{sign}{int}.{frac}")
        }
    } else {
        let sign = if exponent < 0 { '-' } else { '+' };
        format!("{mantissa}e{sign}{:02}", exponent.unsigned_abs())
    }
}

/// transformers' `tojson` filter: `json.dumps(x, ensure_ascii=False, indent=None,
/// separators=None, sort_keys=False)`. Unlike minijinja's own filter it does not HTML-escape,
/// uses Python's `", "`/`": "` separators and keeps key order, all of which show up in prompts.
fn tojson(value: &Value, args: Rest<Value>, kwargs: Kwargs) -> Result<Value, JinjaError> {
    const NAMES: [&str; 4] = ["ensure_ascii", "indent", "separators", "sort_keys"];
    if args.len() > NAMES.len() {
        return Err(JinjaError::new(
            ErrorKind::TooManyArguments,
            "tojson takes at most 4 arguments",
        ));
    }
    let mut options: [Option<Value>; 4] = Default::default();
    for (slot, arg) in options.iter_mut().zip(args.iter()) {
        *slot = Some(arg.clone());
    }
    for (slot, name) in options.iter_mut().zip(NAMES) {
        if let Some(v) = kwargs.get::<Option<Value>>(name)? {
            *slot = Some(v);
        }
    }
    kwargs.assert_all_used()?;
    let [ensure_ascii, indent, separators, sort_keys] = options;
    let indent = match indent.filter(|v| !v.is_none() && !v.is_undefined()) {
        None => None,
        Some(v) if v.kind() == ValueKind::String => {
            Some(v.as_str().unwrap_or_default().to_string())
        }
        Some(v) => {
            let n = v.as_i64().ok_or_else(|| {
                JinjaError::new(
                    ErrorKind::InvalidOperation,
                    format!("tojson: indent must be an int or a string, got {v}"),
                )
            })?;
            Some(" ".repeat(usize::try_from(n).unwrap_or(0)))
        }
    };
    let (item_sep, key_sep) = match separators.filter(|v| !v.is_none() && !v.is_undefined()) {
        Some(v) => {
            let parts: Vec<String> = v
                .try_iter()?
                .map(|p| p.as_str().map(str::to_string))
                .collect::<Option<_>>()
                .unwrap_or_default();
            match <[String; 2]>::try_from(parts) {
                Ok([item, key]) => (item, key),
                Err(_) => {
                    return Err(JinjaError::new(
                        ErrorKind::InvalidOperation,
                        "tojson: separators must be a pair of strings",
                    ))
                }
            }
        }
        None if indent.is_some() => (",".to_string(), ": ".to_string()),
        None => (", ".to_string(), ": ".to_string()),
    };
    let dumper = JsonDumper {
        ensure_ascii: ensure_ascii.is_some_and(|v| v.is_true()),
        indent,
        item_sep,
        key_sep,
        sort_keys: sort_keys.is_some_and(|v| v.is_true()),
    };
    let mut out = String::new();
    dumper.write(&mut out, value, 0)?;
    Ok(Value::from(out))
}

/// Python's `json.dumps(value, ensure_ascii=False)`: how mlx_lm.server writes a tool call's
/// arguments.
pub fn json_dumps(value: &serde_json::Value) -> String {
    let dumper = JsonDumper {
        ensure_ascii: false,
        indent: None,
        item_sep: ", ".into(),
        key_sep: ": ".into(),
        sort_keys: false,
    };
    let mut out = String::new();
    dumper
        .write(&mut out, &Value::from(minijinja::value::Serde(value)), 0)
        .expect("JSON values serialize");
    out
}

/// Python's `json.dumps` over template values.
struct JsonDumper {
    ensure_ascii: bool,
    indent: Option<String>,
    item_sep: String,
    key_sep: String,
    sort_keys: bool,
}

impl JsonDumper {
    fn write(&self, out: &mut String, value: &Value, level: usize) -> Result<(), JinjaError> {
        match value.kind() {
            ValueKind::None => out.push_str("null"),
            ValueKind::Bool => out.push_str(if value.is_true() { "true" } else { "false" }),
            ValueKind::Number if value.is_integer() => out.push_str(&value.to_string()),
            ValueKind::Number => {
                let x = f64::try_from(value.clone())?;
                out.push_str(&if x.is_nan() {
                    "NaN".to_string()
                } else if x.is_infinite() {
                    if x > 0.0 { "Infinity" } else { "-Infinity" }.to_string()
                } else {
                    py_float(x)
                });
            }
            ValueKind::String => self.write_string(out, value.as_str().unwrap_or_default()),
            ValueKind::Seq | ValueKind::Iterable => {
                let items: Vec<Value> = value.try_iter()?.collect();
                self.write_container(out, '[', ']', &items, level, |d, out, item, level| {
                    d.write(out, item, level)
                })?;
            }
            ValueKind::Map => {
                let mut pairs: Vec<(String, Value)> = Vec::new();
                for (k, v) in map_pairs(value) {
                    pairs.push((self.key_string(&k)?, v));
                }
                if self.sort_keys {
                    pairs.sort_by(|a, b| a.0.cmp(&b.0));
                }
                self.write_container(out, '{', '}', &pairs, level, |d, out, (k, v), level| {
                    d.write_string(out, k);
                    out.push_str(&d.key_sep);
                    d.write(out, v, level)
                })?;
            }
            kind => {
                return Err(JinjaError::new(
                    ErrorKind::InvalidOperation,
                    format!("tojson: object of type {kind} is not JSON serializable"),
                ))
            }
        }
        Ok(())
    }

    fn write_container<T>(
        &self,
        out: &mut String,
        open: char,
        close: char,
        items: &[T],
        level: usize,
        mut write_item: impl FnMut(&Self, &mut String, &T, usize) -> Result<(), JinjaError>,
    ) -> Result<(), JinjaError> {
        out.push(open);
        if items.is_empty() {
            out.push(close);
            return Ok(());
        }
        for (i, item) in items.iter().enumerate() {
            if i > 0 {
                out.push_str(&self.item_sep);
            }
            if let Some(indent) = &self.indent {
                out.push('\n');
                out.push_str(&indent.repeat(level + 1));
            }
            write_item(self, out, item, level + 1)?;
        }
        if let Some(indent) = &self.indent {
            out.push('\n');
            out.push_str(&indent.repeat(level));
        }
        out.push(close);
        Ok(())
    }

    /// Python converts non-string keys the way it prints them as JSON scalars.
    fn key_string(&self, key: &Value) -> Result<String, JinjaError> {
        match key.kind() {
            ValueKind::String => Ok(key.as_str().unwrap_or_default().to_string()),
            ValueKind::None | ValueKind::Bool | ValueKind::Number => {
                let mut s = String::new();
                self.write(&mut s, key, 0)?;
                Ok(s)
            }
            kind => Err(JinjaError::new(
                ErrorKind::InvalidOperation,
                format!("tojson: keys must be str, int, float, bool or None, not {kind}"),
            )),
        }
    }

    fn write_string(&self, out: &mut String, s: &str) {
        out.push('"');
        for c in s.chars() {
            match c {
                '"' => out.push_str("\\\""),
                '\\' => out.push_str("\\\\"),
                '\n' => out.push_str("\\n"),
                '\r' => out.push_str("\\r"),
                '\t' => out.push_str("\\t"),
                '\u{8}' => out.push_str("\\b"),
                '\u{c}' => out.push_str("\\f"),
                c if (c as u32) < 0x20 => out.push_str(&format!("\\u{:04x}", c as u32)),
                c if self.ensure_ascii && !c.is_ascii() => {
                    let mut units = [0u16; 2];
                    for unit in c.encode_utf16(&mut units) {
                        out.push_str(&format!("\\u{unit:04x}"));
                    }
                }
                c => out.push(c),
            }
        }
        out.push('"');
    }
}
