"""Helpers of the test suite: processes, brokers, factories, proxies and servers the tests share."""
