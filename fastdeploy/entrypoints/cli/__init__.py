"""The ``fastdeploy`` command line: a dispatcher and one module per subcommand."""
