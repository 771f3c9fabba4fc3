//! The optional manual-test panel: one page, embedded in the binary, with a prompt, sliders for
//! `max_tokens`, `temperature` and `top_p`, Generate and Score buttons, and the output with its
//! usage. `hrm serve --ui` serves it at `/ui`; `hrm ui --server-url URL` serves it on its own,
//! pointed at another server (which then needs `--enable-cors` for the page's origin).

use axum::Router;
use axum::response::Html;
use axum::routing::get;

const PAGE: &str = include_str!("ui.html");

/// The page, calling the API at `api_base` (empty: the page's own origin).
pub fn page(api_base: &str) -> String {
    let escaped = api_base
        .replace('&', "&amp;")
        .replace('"', "&quot;")
        .replace('<', "&lt;")
        .replace('>', "&gt;");
    PAGE.replace("{{API_BASE}}", &escaped)
}

/// A router serving only the page, at `/` and `/ui`.
pub fn standalone<S: Clone + Send + Sync + 'static>(api_base: &str) -> Router<S> {
    let html = Html(page(api_base));
    let again = html.clone();
    Router::new()
        .route("/", get(move || async move { html }))
        .route("/ui", get(move || async move { again }))
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_api_base_is_escaped_into_the_page() {
        let page = super::page("http://x\"><script>");
        assert!(page.contains(r#"content="http://x&quot;&gt;&lt;script&gt;""#));
        assert!(page.contains("id=\"generate\"") && page.contains("id=\"score\""));
        assert!(
            page.contains("id=\"max_tokens\"")
                && page.contains("id=\"temperature\"")
                && page.contains("id=\"top_p\"")
        );
    }
}
