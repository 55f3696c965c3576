"""Command-line options of `python -m graph_runtime bench`."""


def add_bench_arguments(parser) -> None:
    parser.add_argument("--scenarios", default="default", help="'default', 'quick' or a comma list of names")
    parser.add_argument("--paths", default="default",
                        help="comma list of paths, 'default' (diffusers, eager, graph, compile+graph) or 'all'")
    parser.add_argument("--layers", type=int, default=32, help="transformer blocks (32 = the real model)")
    parser.add_argument("--iters", type=int, default=10, help="timed decode steps per path (median reported)")
    parser.add_argument("--out-dir", default="bench/results", help="where the markdown and JSON results go")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tiny", action="store_true", help="the tiny 2-block model (a CPU smoke run of the bench)")
    parser.add_argument("--profile", action="store_true", help="also print a kernel table of the fastest path")
