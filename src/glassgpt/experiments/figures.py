"""The figure helpers' old address: they live in `glassgpt.figures`, one layer down, so that
bench/ draws without importing the experiments. Kept so that `glassgpt.experiments.figures`
imports still work."""

from glassgpt.figures import (  # noqa: F401  (re-exported)
    CHAR_WIDTH_EM,
    DPI,
    LABEL_PT,
    MASKED_FACE,
    MASKED_HATCH,
    MASKED_NOTE,
    SUPTITLE_PT,
    TICK_PT,
    TITLE_PT,
    grid_shape,
    label_axes,
    labelled_colorbar,
    new_figure,
    save_figure,
    show_attention,
    text_height,
    wrap_title,
)
