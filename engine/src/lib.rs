//! The inference engine.
