"""MkDocs hooks (mkdocs.yml ``hooks:``): the config reference page is generated at build time from the
schemas (``csframework.config_reference``), where it says ``<!-- config-reference -->``."""
from __future__ import annotations

MARKER = "<!-- config-reference -->"


def on_page_markdown(markdown: str, page, config, files) -> str:  # noqa: ARG001 (MkDocs passes them by name)
    if MARKER not in markdown:
        return markdown
    from csframework.config_reference import markdown as reference

    return markdown.replace(MARKER, reference())
