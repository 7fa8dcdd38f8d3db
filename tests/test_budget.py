import pytest

from memfit import BudgetFormatError, MemfitError, format_bytes, parse_bytes

GiB = 2**30


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("24GB", 24 * GiB),
        ("24GiB", 24 * GiB),
        ("24G", 24 * GiB),
        ("24gB", 24 * GiB),
        ("24giB", 24 * GiB),
        (" 24 GB ", 24 * GiB),
        ("1536MB", 1536 * 2**20),
        ("1536MiB", 1536 * 2**20),
        ("0.5TB", 512 * GiB),
        ("512KB", 512 * 1024),
        ("1000", 1000),
        ("1000B", 1000),
        ("1.5G", 3 * GiB // 2),
        (4096, 4096),
    ],
)
def test_parse(text, expected):
    assert parse_bytes(text) == expected


@pytest.mark.parametrize("text", ["", "GB", "24XB", "24 GBs", "-1GB", "0", "abc", "1e400GB", "24iB"])
def test_parse_rejects(text):
    with pytest.raises(BudgetFormatError) as info:
        parse_bytes(text)
    assert isinstance(info.value, MemfitError)


@pytest.mark.parametrize(
    ("text", "message"),
    [("300Mb", "in bits"), ("24gb", "write 24GB"), ("0.5", "less than one byte"), ("1e-3", "did you mean 1e-3GB")],
)
def test_parse_explains(text, message):
    with pytest.raises(BudgetFormatError, match=message):
        parse_bytes(text)


def test_format():
    assert format_bytes(24 * GiB) == "24.00 GiB"
    assert format_bytes(1536 * 2**20) == "1.50 GiB"
    assert format_bytes(300 * 2**20) == "300.00 MiB"
    assert format_bytes(512) == "512 B"
    assert format_bytes(-2048, signed=True) == "-2.00 KiB"
