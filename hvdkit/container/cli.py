"""`hvdkit image`: build hvdkit's image, make the local Debian base, save an image for Apptainer.

    hvdkit image build [--base IMAGE|local] [--gpu] [--target hvdkit|jupyter] [--tag TAG] [--engine podman|docker]
    hvdkit image base                 make (or find) the local base and print its tag
    hvdkit image save IMAGE FILE      an OCI archive (apptainer build img.sif oci-archive://FILE)

Each prints what it made on its last line (the tag, or the file); a problem is one line and exit
1 (2 for bad flags), with no image tagged from a build that did not finish.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Optional, Sequence

from hvdkit import job
from hvdkit.args import OneLineParser
from hvdkit.container import image
from hvdkit.container.engine import EngineError, find_engine


def _parser() -> argparse.ArgumentParser:
    parser = OneLineParser(prog="hvdkit image", description="hvdkit's container image (docs/containers.md)")
    parser.add_argument("--engine", choices=("podman", "docker"),
                        help="the container engine (default: $HVDKIT_CONTAINER_ENGINE, else podman, else docker)")
    sub = parser.add_subparsers(dest="action", required=True, metavar="ACTION", parser_class=OneLineParser)
    build = sub.add_parser("build", help="build the image from the repository's Dockerfile and print its tag")
    build.add_argument("--base", default=None,
                       help=f"the image to start from (default {image.CPU_BASE}, with --gpu {image.GPU_BASE}); "
                            f"'{image.LOCAL_BASE}': a Debian base made here with mmdebstrap (no registry needed)")
    build.add_argument("--gpu", action="store_true", help="a GPU image: Horovod with NCCL, or no image")
    build.add_argument("--target", choices=image.TARGETS, default="hvdkit",
                       help="hvdkit (training; the default) or jupyter (the same with JupyterLab on port 8888)")
    build.add_argument("--tag", help="the image's name (default localhost/hvdkit:VERSION-cpu|cuda13[-jupyter])")
    build.add_argument("--context", type=Path, help="the hvdkit checkout to build from (default: this one)")
    sub.add_parser("base", help="make the local Debian base with mmdebstrap (cached) and print its tag")
    save = sub.add_parser("save", help="write an image as an OCI archive, for apptainer build or enroot")
    save.add_argument("image")
    save.add_argument("output", type=Path)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = _parser().parse_args(argv)

    def say(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    try:
        engine = find_engine(args.engine)
        if args.action == "base":
            print(image.make_base(engine, say=say))
        elif args.action == "save":
            done = image.save(engine, args.image, args.output)
            print(done)
        else:
            base = args.base or (image.GPU_BASE if args.gpu else image.CPU_BASE)
            tag = args.tag or image.default_tag(args.gpu, args.target)
            print(image.build(engine, image.BuildRequest(base=base, tag=tag, target=args.target, gpu=args.gpu,
                                                         context=args.context), say=say))
    except EngineError as exc:
        print(f"hvdkit image: {exc}", file=sys.stderr)
        return job.FAILED
    return job.OK
