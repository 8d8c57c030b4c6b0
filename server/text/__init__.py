"""Text processing before and after decoding: markup, splitting, documents, placeholders, tag placement."""
