//! Cluster plans (filled in below).
