"""``dali-pipes synth``: benchmark and demo data, drawn (:mod:`converters.synth`) or cropped from real photos
(:mod:`converters.photo_crops`)."""

from __future__ import annotations

import argparse
from pathlib import Path

from dali_pipes.cli.words import counted


def add_synth(commands: argparse._SubParsersAction) -> None:
    """``dali-pipes synth``: an image folder of drawn photo-like JPEGs, or of crops of real photos."""
    p = commands.add_parser("synth", help="write an ImageNet-like folder of synthetic photo-like JPEGs")
    p.add_argument("out", type=Path)
    p.add_argument("--num", type=int, default=1000, help="number of images (default: 1000)")
    p.add_argument("--size", default="500x375", help="WIDTHxHEIGHT (default: 500x375)")
    p.add_argument("--classes", type=int, default=10, help="number of class folders (default: 10)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quality", type=int, default=90, help="JPEG quality (default: 90)")
    p.add_argument("--workers", type=int, help="processes (default: all cores)")
    p.add_argument(
        "--photos",
        nargs="?",
        const="",
        metavar="DIR",
        help="crops of real photos (a class-folder tree; alone: the package's sample photos) instead of drawn images",
    )
    p.set_defaults(handler=_synth)


def _synth(args) -> int:
    from converters.synth import make_imagefolder, parse_size

    if args.num < 1 or args.classes < 1:
        raise ValueError("--num and --classes must be at least 1")
    if args.photos is not None:
        from converters.photo_crops import make_photo_crops

        out = make_photo_crops(
            args.out,
            args.num,
            photos=args.photos or None,
            size=parse_size(args.size),
            seed=args.seed,
            quality=args.quality,
            workers=args.workers,
        )
        print(f"{out}: {counted(args.num, 'crop')} of real photos, in their photos' class folders")
        return 0
    out = make_imagefolder(
        args.out,
        args.num,
        size=parse_size(args.size),
        classes=args.classes,
        seed=args.seed,
        quality=args.quality,
        workers=args.workers,
    )
    print(f"{out}: {counted(args.num, 'image')} in {counted(args.classes, 'class folder')}")
    return 0
