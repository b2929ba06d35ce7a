//! Named registries (filled in below).
