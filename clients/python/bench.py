"""``python clients/python/bench.py --url … --queue … --count 5000``: see baton_client/bench.py."""

from baton_client.bench import main

if __name__ == "__main__":
    main()
