"""A minimal third-party backend package, as docs/guides/backends.md shows it: device type TOY (``device=toy``),
its own settings (``backend.lr_scale``), validation rule and config files. Registered through an entry point
(``toy = toy_backend.plugin``) in the tests that use it."""
