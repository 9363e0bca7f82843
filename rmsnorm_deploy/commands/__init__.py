"""One module per ``rmsnorm-deploy`` subcommand: ``add_arguments(parser)`` and ``run(args) -> int``."""
