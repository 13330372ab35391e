//! Chat-template rendering with minijinja, set up the way Hugging Face (and llama.cpp's
//! Jinja path) render `tokenizer.chat_template`: trimmed blocks, Python string methods,
//! `raise_exception`, a Python-style `tojson`.

use minijinja::value::{Kwargs, Value};
use minijinja::{Environment, Error, ErrorKind, context};
use serde::{Deserialize, Serialize};

use super::TokenizerError;

/// One message of a conversation, as chat templates receive it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ChatMessage {
    pub role: String,
    pub content: String,
}

impl ChatMessage {
    pub fn new(role: impl Into<String>, content: impl Into<String>) -> Self {
        ChatMessage {
            role: role.into(),
            content: content.into(),
        }
    }
}

/// ChatML, used only when a model carries no template but has ChatML's tokens.
pub(crate) const CHATML: &str = "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}";

/// Steps a template may take (minijinja's fuel: about one per instruction).
/// Real templates take a few thousand per message; one that loops without
/// end (a hostile or broken GGUF) stops here instead of hanging the caller.
pub(crate) const TEMPLATE_FUEL: u64 = 5_000_000;

pub(crate) fn render(
    template: &str,
    messages: &[ChatMessage],
    add_generation_prompt: bool,
    bos_token: &str,
    eos_token: &str,
) -> Result<String, TokenizerError> {
    let mut env = Environment::new();
    // Jinja2 as transformers configures it for chat templates.
    env.set_trim_blocks(true);
    env.set_lstrip_blocks(true);
    env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
    env.set_fuel(Some(TEMPLATE_FUEL));
    env.add_function("raise_exception", raise_exception);
    env.add_filter("tojson", tojson);
    // No clock on wasm32-unknown-unknown: templates that use it test `strftime_now is
    // defined` and fall back to a fixed date.
    #[cfg(not(target_arch = "wasm32"))]
    env.add_function("strftime_now", strftime_now);
    let tmpl = env
        .template_from_str(template)
        .map_err(|e| TokenizerError::Template(describe(&e)))?;
    tmpl.render(context! {
        messages => messages,
        add_generation_prompt => add_generation_prompt,
        bos_token => bos_token,
        eos_token => eos_token,
    })
    .map_err(|e| {
        if e.kind() == ErrorKind::OutOfFuel {
            TokenizerError::Template(format!(
                "the chat template did not finish within {TEMPLATE_FUEL} steps \
                 (it may loop without end): {}",
                describe(&e)
            ))
        } else {
            TokenizerError::Template(describe(&e))
        }
    })
}

/// minijinja's Display leaves out the cause chain and line; both help when a model's
/// template fails.
fn describe(e: &Error) -> String {
    let mut s = e.to_string();
    let mut src = std::error::Error::source(e);
    while let Some(cause) = src {
        s.push_str(": ");
        s.push_str(&cause.to_string());
        src = cause.source();
    }
    s
}

fn raise_exception(message: String) -> Result<Value, Error> {
    Err(Error::new(ErrorKind::InvalidOperation, message))
}

/// `json.dumps` as transformers calls it: non-ASCII kept, `", "` and `": "` separators,
/// optional `indent`. minijinja's own `tojson` escapes for HTML, which templates don't want.
fn tojson(value: Value, kwargs: Kwargs) -> Result<Value, Error> {
    let indent: Option<usize> = kwargs.get("indent")?;
    // Accepted for compatibility; keys keep insertion order as in Python.
    let _: Option<bool> = kwargs.get("ensure_ascii")?;
    let _: Option<bool> = kwargs.get("sort_keys")?;
    kwargs.assert_all_used()?;
    let mut out = Vec::new();
    let result = match indent {
        Some(n) => {
            let pad = vec![b' '; n];
            let fmt = serde_json::ser::PrettyFormatter::with_indent(&pad);
            let mut ser = serde_json::Serializer::with_formatter(&mut out, fmt);
            value.serialize(&mut ser)
        }
        None => {
            let mut ser = serde_json::Serializer::with_formatter(&mut out, PySeparators);
            value.serialize(&mut ser)
        }
    };
    result.map_err(|e| Error::new(ErrorKind::InvalidOperation, format!("tojson: {e}")))?;
    let s = String::from_utf8(out)
        .map_err(|e| Error::new(ErrorKind::InvalidOperation, format!("tojson: {e}")))?;
    Ok(Value::from_safe_string(s))
}

/// Python's default `json.dumps` separators.
struct PySeparators;

impl serde_json::ser::Formatter for PySeparators {
    fn begin_array_value<W: ?Sized + std::io::Write>(
        &mut self,
        writer: &mut W,
        first: bool,
    ) -> std::io::Result<()> {
        if first {
            Ok(())
        } else {
            writer.write_all(b", ")
        }
    }

    fn begin_object_key<W: ?Sized + std::io::Write>(
        &mut self,
        writer: &mut W,
        first: bool,
    ) -> std::io::Result<()> {
        if first {
            Ok(())
        } else {
            writer.write_all(b", ")
        }
    }

    fn begin_object_value<W: ?Sized + std::io::Write>(
        &mut self,
        writer: &mut W,
    ) -> std::io::Result<()> {
        writer.write_all(b": ")
    }
}

/// `datetime.now().strftime(fmt)` for the specifiers chat templates use (dates in system
/// prompts), in UTC.
#[cfg(not(target_arch = "wasm32"))]
fn strftime_now(fmt: String) -> Result<String, Error> {
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0);
    Ok(strftime(&fmt, secs))
}

#[cfg(not(target_arch = "wasm32"))]
fn strftime(fmt: &str, unix_secs: u64) -> String {
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
    const DAYS: [&str; 7] = [
        "Monday",
        "Tuesday",
        "Wednesday",
        "Thursday",
        "Friday",
        "Saturday",
        "Sunday",
    ];
    let days = (unix_secs / 86_400) as i64;
    let secs_of_day = unix_secs % 86_400;
    let (year, month, day) = civil_from_days(days);
    // 1970-01-01 was a Thursday (index 3 with Monday = 0).
    let weekday = (days + 3).rem_euclid(7) as usize;
    let month_name = MONTHS[(month - 1) as usize];
    let day_name = DAYS[weekday];
    let mut out = String::new();
    let mut chars = fmt.chars();
    while let Some(c) = chars.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        match chars.next() {
            Some('Y') => out.push_str(&year.to_string()),
            Some('y') => out.push_str(&format!("{:02}", year.rem_euclid(100))),
            Some('m') => out.push_str(&format!("{month:02}")),
            Some('d') => out.push_str(&format!("{day:02}")),
            Some('B') => out.push_str(month_name),
            Some('b') => out.push_str(&month_name[..3]),
            Some('A') => out.push_str(day_name),
            Some('a') => out.push_str(&day_name[..3]),
            Some('H') => out.push_str(&format!("{:02}", secs_of_day / 3600)),
            Some('M') => out.push_str(&format!("{:02}", secs_of_day / 60 % 60)),
            Some('S') => out.push_str(&format!("{:02}", secs_of_day % 60)),
            Some('%') => out.push('%'),
            Some(other) => {
                out.push('%');
                out.push(other);
            }
            None => out.push('%'),
        }
    }
    out
}

/// Proleptic Gregorian (year, month, day) of a day count since 1970-01-01.
#[cfg(not(target_arch = "wasm32"))]
fn civil_from_days(z: i64) -> (i64, u32, u32) {
    let z = z + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let month = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    let year = yoe + era * 400 + i64::from(month <= 2);
    (year, month, day)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn user(content: &str) -> Vec<ChatMessage> {
        vec![ChatMessage::new("user", content)]
    }

    #[test]
    fn chatml_renders_generation_prompt() {
        let s = render(CHATML, &user("hi"), true, "", "").unwrap();
        assert_eq!(s, "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n");
        let s = render(CHATML, &user("hi"), false, "", "").unwrap();
        assert_eq!(s, "<|im_start|>user\nhi<|im_end|>\n");
    }

    #[test]
    fn python_string_methods_and_trimmed_blocks() {
        // As Jinja2 renders it: the newline after a block tag and the indentation before one
        // are dropped, indentation before an expression is kept.
        let t = "{% for m in messages %}\n  {% if true %}\n  {{ m.content.strip() | upper }}|{{ m.role.startswith('us') }}\n  {% endif %}\n{% endfor %}";
        let s = render(t, &user("  hey  "), false, "", "").unwrap();
        assert_eq!(s, "  HEY|True\n");
    }

    #[test]
    fn raise_exception_is_an_error_not_a_panic() {
        let t = "{{ raise_exception('roles must alternate') }}";
        let err = render(t, &user("x"), false, "", "").unwrap_err();
        assert!(err.to_string().contains("roles must alternate"), "{err}");
    }

    #[test]
    fn a_template_that_loops_without_end_stops_with_a_clear_error() {
        let t = "{% for a in range(100000) %}{% for b in range(100000) %}{% endfor %}{% endfor %}";
        let t0 = std::time::Instant::now();
        let err = render(t, &user("x"), false, "", "")
            .unwrap_err()
            .to_string();
        assert!(err.contains("did not finish within"), "{err}");
        assert!(t0.elapsed() < std::time::Duration::from_secs(30));
        // A real template with many messages stays far below the budget.
        let many: Vec<_> = (0..2000)
            .map(|i| ChatMessage::new("user", i.to_string()))
            .collect();
        assert!(render(CHATML, &many, true, "", "").is_ok());
    }

    #[test]
    fn syntax_error_is_reported() {
        let err = render("{% for %}", &user("x"), false, "", "").unwrap_err();
        assert!(matches!(err, TokenizerError::Template(_)));
    }

    #[test]
    fn tojson_matches_python_json_dumps() {
        let t = "{{ messages[0] | tojson }}";
        let s = render(t, &user("é <b>"), false, "", "").unwrap();
        assert_eq!(s, r#"{"role": "user", "content": "é <b>"}"#);
    }

    #[test]
    fn bos_and_eos_variables() {
        let s = render("{{ bos_token }}x{{ eos_token }}", &[], false, "<s>", "</s>").unwrap();
        assert_eq!(s, "<s>x</s>");
    }

    #[cfg(not(target_arch = "wasm32"))]
    #[test]
    fn strftime_formats_known_dates() {
        // 2024-07-26 12:34:56 UTC, a Friday.
        assert_eq!(
            strftime("%d %b %Y %H:%M:%S %A %%", 1_721_997_296),
            "26 Jul 2024 12:34:56 Friday %"
        );
        assert_eq!(strftime("%Y-%m-%d", 951_782_400), "2000-02-29");
    }
}
