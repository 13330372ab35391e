//! Browser worker (filled by the browser-worker issue).
