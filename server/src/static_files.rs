//! The directory given by `--static`, served at `/` (the browser worker's
//! page, so a phone needs nothing but the URL).

use std::path::Path;

use tower_http::services::ServeDir;

pub(crate) fn service(dir: &Path) -> ServeDir {
    // ServeDir refuses paths that climb out of `dir` (`..`, absolute paths).
    ServeDir::new(dir).append_index_html_on_directories(true)
}
