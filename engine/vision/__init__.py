"""Images for the vision tower: decoding and preprocessing (`preprocess.py`)."""
