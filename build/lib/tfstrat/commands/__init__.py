"""The `tfstrat` command: `main` builds the parser from one module per subcommand."""
