"""Read a report PNG back: its size and, per panel, how many pixels carry a data colour."""

from __future__ import annotations


def colored_pixels(figure) -> dict[str, int]:
    """Pixels inside each panel's box whose colour is saturated (data lines and markers; axes, ticks, grid and
    text are black or grey). The PNG is read from disk, so this checks what a person sees."""
    import matplotlib.image as mpimg

    img = mpimg.imread(figure.path)
    assert img.shape[1] == figure.size[0] and img.shape[0] == figure.size[1], (img.shape, figure.size)
    rgb = img[..., :3]
    saturated = (rgb.max(axis=2) - rgb.min(axis=2)) > 0.25
    return {name: int(saturated[top:bottom, left:right].sum())
            for name, (left, top, right, bottom) in figure.boxes.items()}
