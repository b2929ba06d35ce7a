//! The `tensorwire` command-line tool.
fn main() {}
