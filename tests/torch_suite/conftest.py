collect_ignore_glob = ["*"]  # run by `make test-torch-suite`, not by pytest
