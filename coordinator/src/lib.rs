//! coordinator: filled by a later issue. Dependency direction is fixed now (see STYLE.md).
