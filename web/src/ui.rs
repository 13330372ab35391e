//! The few DOM updates the join page needs. Text only (never HTML), so nothing a peer or
//! an adapter reports can inject markup.

use wasm_bindgen::JsCast;
use web_sys::{Document, Element, HtmlElement, HtmlProgressElement};

fn document() -> Option<Document> {
    web_sys::window()?.document()
}

fn element(id: &str) -> Option<Element> {
    document()?.get_element_by_id(id)
}

/// Sets the text of the element with `id`, if the page has one.
pub fn set_text(id: &str, text: &str) {
    if let Some(e) = element(id) {
        e.set_text_content(Some(text));
    }
}

pub fn set_status(text: &str) {
    set_text("status", text);
    web_sys::console::log_1(&format!("cairn: {text}").into());
}

pub fn set_hidden(id: &str, hidden: bool) {
    if let Some(e) = element(id).and_then(|e| e.dyn_into::<HtmlElement>().ok()) {
        e.set_hidden(hidden);
    }
}

/// Shows `done` of `total` on the `<progress id="progress">` and its label.
pub fn set_progress(done: u64, total: u64, label: &str) {
    if let Some(p) = element("progress").and_then(|e| e.dyn_into::<HtmlProgressElement>().ok()) {
        p.set_max(total.max(1) as f64);
        p.set_value(done as f64);
        p.set_hidden(false);
    }
    set_text("progress-label", label);
}

/// Replaces the rows of the `<dl id="env">` list with `rows` (term, description).
pub fn set_rows(id: &str, rows: &[(String, String)]) {
    let (Some(doc), Some(list)) = (document(), element(id)) else {
        return;
    };
    list.set_text_content(None);
    for (term, desc) in rows {
        if let (Ok(dt), Ok(dd)) = (doc.create_element("dt"), doc.create_element("dd")) {
            dt.set_text_content(Some(term));
            dd.set_text_content(Some(desc));
            let _ = list.append_child(&dt);
            let _ = list.append_child(&dd);
        }
    }
}

/// Adds a line to the page's log (newest last, the last 200 kept).
pub fn log(text: &str) {
    web_sys::console::log_1(&format!("cairn: {text}").into());
    let (Some(doc), Some(list)) = (document(), element("log")) else {
        return;
    };
    if let Ok(li) = doc.create_element("li") {
        li.set_text_content(Some(text));
        let _ = list.append_child(&li);
    }
    while list.child_element_count() > 200 {
        if let Some(first) = list.first_element_child() {
            first.remove();
        }
    }
}

pub fn human_bytes(n: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = n as f64;
    let mut u = 0;
    while v >= 1024.0 && u + 1 < UNITS.len() {
        v /= 1024.0;
        u += 1;
    }
    if u == 0 {
        format!("{n} B")
    } else {
        format!("{v:.1} {}", UNITS[u])
    }
}
