"""A seeded fictional world, its wiki-style corpus, and multi-hop questions about it.

Everything is invented (names built from syllables), so a model cannot know an answer without
searching. The world holds countries, cities (each in one country), people (each born in one
city) and companies (each founded by a distinct person, headquartered in one city). One document
per entity, `{"id", "contents": "Title\\ntext"}`; a person's document does not mention the company
they founded, so the questions below need two lookups:

  founder_city:  "In which city was the founder of {company} born?"   company -> founder -> city
  person_country:"In which country was {person} born?"                 person -> city -> country
  hq_country:    "In which country is {company} headquartered?"        company -> city -> country

`make_world(seed, n_questions)` sizes the world so that there are at least `n_questions` distinct
questions; `split_questions` shuffles them (seeded) and gives val the first `num_val`, train the
next `num_train`, so the splits are disjoint and share one corpus.
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

_ONSETS = ["b", "br", "d", "dr", "f", "g", "gr", "k", "kr", "l", "m", "n", "p", "qu", "r", "s", "st", "t",
           "tr", "v", "vr", "z", "zh", "th", "x"]
_VOWELS = ["a", "e", "i", "o", "u", "ai", "ou", "ei", "y"]
_CODAS = ["", "", "n", "r", "l", "x", "sk", "m", "th", "nd"]
_PROFESSIONS = ["engineer", "chemist", "painter", "architect", "economist", "pilot", "botanist", "composer",
                "surgeon", "astronomer", "geologist", "novelist"]
_INDUSTRIES = ["software", "shipping", "mining", "textile", "aerospace", "pharmaceutical", "furniture",
               "robotics", "food", "energy"]
_SUFFIXES = ["Corp", "Industries", "Labs", "Works", "Holdings", "Systems"]


def _word(rng: random.Random, syllables: int) -> str:
    w = "".join(rng.choice(_ONSETS) + rng.choice(_VOWELS) for _ in range(syllables)) + rng.choice(_CODAS)
    return w.capitalize()


@dataclass(frozen=True)
class Question:
    kind: str
    question: str
    answer: str
    hops: tuple[str, ...]  # titles of the documents needed, in order


@dataclass
class World:
    countries: list[str]
    cities: dict[str, str]  # city -> country
    people: dict[str, dict[str, Any]]  # name -> {city, profession, year}
    companies: dict[str, dict[str, Any]]  # name -> {founder, hq, industry, year}

    def documents(self) -> list[dict[str, str]]:
        """The corpus: one {"id", "contents": "Title\\ntext"} per entity, ids d0, d1, ..."""
        texts = []
        for country in self.countries:
            cities = sorted(c for c, k in self.cities.items() if k == country)
            listed = ", ".join(cities) if cities else "no large cities"
            texts.append((country, f"{country} is a country. Its cities include {listed}."))
        for city, country in self.cities.items():
            texts.append((city, f"{city} is a city in the country of {country}."))
        for name, p in self.people.items():
            art = "an" if p["profession"][0] in "aeiou" else "a"
            texts.append((name, f"{name} is {art} {p['profession']} who was born in the city of {p['city']} "
                                f"in {p['year']}."))
        for name, c in self.companies.items():
            art = "an" if c["industry"][0] in "aeiou" else "a"
            texts.append((name, f"{name} is {art} {c['industry']} company founded in {c['year']} by {c['founder']}. "
                                f"Its headquarters are in the city of {c['hq']}."))
        return [{"id": f"d{i}", "contents": f"{title}\n{text}"} for i, (title, text) in enumerate(texts)]

    def questions(self) -> list[Question]:
        qs = []
        for name, c in self.companies.items():
            founder = c["founder"]
            city = self.people[founder]["city"]
            qs.append(Question("founder_city", f"In which city was the founder of {name} born?", city,
                               (name, founder)))
            qs.append(Question("hq_country", f"In which country is {name} headquartered?",
                               self.cities[c["hq"]], (name, c["hq"])))
        for name, p in self.people.items():
            qs.append(Question("person_country", f"In which country was {name} born?", self.cities[p["city"]],
                               (name, p["city"])))
        return qs


def make_world(seed: int, n_questions: int) -> World:
    """A world with at least `n_questions` distinct questions; a pure function of its arguments."""
    if n_questions < 1:
        raise ValueError(f"search_r1 needs at least one question, got n_questions={n_questions}")
    rng = random.Random(f"asyncrl-search_r1-{seed}")
    n_companies = math.ceil(n_questions / 4) + 2
    n_people = 2 * n_companies
    n_cities = max(8, n_people // 4)
    n_countries = max(4, n_cities // 5)
    used: set[str] = set()

    def fresh(make) -> str:
        while True:
            w = make()
            if w.lower() not in used:
                used.add(w.lower())
                return w

    countries = [fresh(lambda: _word(rng, 3)) for _ in range(n_countries)]
    cities = {fresh(lambda: _word(rng, 2)): rng.choice(countries) for _ in range(n_cities)}
    city_names = list(cities)
    people = {}
    for _ in range(n_people):
        name = f"{fresh(lambda: _word(rng, 2))} {fresh(lambda: _word(rng, 2))}"  # no part names a city
        people[name] = {"city": rng.choice(city_names), "profession": rng.choice(_PROFESSIONS),
                        "year": rng.randint(1931, 1999)}
    founders = rng.sample(list(people), n_companies)
    companies = {}
    for founder in founders:
        name = fresh(lambda: f"{_word(rng, 2)} {rng.choice(_SUFFIXES)}")
        hq = rng.choice([c for c in city_names if c != people[founder]["city"]])  # no one-document shortcut
        companies[name] = {"founder": founder, "hq": hq, "industry": rng.choice(_INDUSTRIES),
                           "year": rng.randint(1950, 2020)}
    return World(countries, cities, people, companies)


def split_questions(world: World, seed: int, num_train: int, num_val: int) -> dict[str, list[Question]]:
    """Seeded shuffle of all questions; val = the first num_val, train = the next num_train (disjoint)."""
    qs = world.questions()
    if num_train + num_val > len(qs):
        raise ValueError(f"the world has {len(qs)} questions, fewer than num_train + num_val = {num_train + num_val}")
    random.Random(f"asyncrl-search_r1-split-{seed}").shuffle(qs)
    return {"val": qs[:num_val], "train": qs[num_val:num_val + num_train]}


def write_corpus(docs: list[dict[str, str]], path: str | Path) -> Path:
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    with open(p, "w", encoding="utf-8") as f:
        for d in docs:
            f.write(json.dumps(d, ensure_ascii=False) + "\n")
    return p


def load_corpus(path: str | Path) -> list[dict[str, str]]:
    """Corpus jsonl lines {"id", "contents"}; a bad line raises ValueError naming its line number."""
    p = Path(path).expanduser()
    if not p.is_file():
        raise ValueError(f"corpus file {str(path)!r} not found (resolved to {p.resolve()})")
    docs = []
    with open(p, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                d = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{lineno}: not JSON: {e}") from None
            if not isinstance(d, dict) or not isinstance(d.get("contents"), str):
                raise ValueError(f"{path}:{lineno}: expected an object with a string 'contents' (and 'id')")
            docs.append({"id": str(d.get("id", len(docs))), "contents": d["contents"]})
    if not docs:
        raise ValueError(f"corpus file {path} holds no documents")
    return docs
