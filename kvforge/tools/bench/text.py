"""The English text every benchmark reads: a technical report to ask questions about, prompts unrelated to it,
and a tutoring chat. Shared by llm_bench and the scripts in experiments/ so their workloads stay the same."""

from __future__ import annotations

import itertools
from collections.abc import Callable

DOCUMENT_SECTIONS = [
    "Technical Report TR-117: Commissioning of the Harbor Point Tidal Energy Array\n"
    "Prepared by the Joint Engineering Office of Kestrel Marine Power and the Port of Alderney Bay.",

    "1. Summary\n"
    "This report describes the design, installation and first eighteen months of operation of the Harbor "
    "Point tidal energy array, a group of fourteen seabed-mounted turbines anchored in the narrow channel "
    "between Alderney Bay and the open sea. Construction began in March 2019 and the final turbine was "
    "connected to the grid in October 2021. During its first full year the array delivered 41.6 gigawatt "
    "hours of electricity, enough for roughly eleven thousand homes, at an average capacity factor of "
    "thirty-four percent. The review board, chaired by Dr. Imogen Vasquez, concluded that the project met "
    "every contractual target except the availability figure for the winter months, which fell short "
    "because of cable faults described in section 6.",

    "2. Site selection\n"
    "Three candidate sites were surveyed between 2014 and 2016. The channel at Harbor Point was chosen "
    "because its peak spring currents reach 3.9 metres per second, its depth of 32 to 41 metres leaves "
    "enough clearance above the rotors for shipping, and its bed of fractured granite offers a firm base "
    "for gravity foundations. The two rejected sites, at Gull Rock and at the mouth of the Fenner estuary, "
    "had faster currents but either lay across a busy ferry route or sat on shifting sand that would have "
    "required piled foundations at nearly twice the cost. Acoustic Doppler profilers recorded the flow for "
    "two full years so that the designers could estimate turbulence, wave loading and the asymmetry "
    "between flood and ebb tides, which at this site amounts to about eleven percent.",

    "3. Turbine design\n"
    "Each turbine has a three-bladed rotor of eighteen metres diameter driving a permanent magnet "
    "generator rated at 1.2 megawatts. The blades were supplied by Norrland Composites of Umea, who built "
    "them from glass and carbon fibre laminates with a polyurethane leading-edge coating to resist "
    "cavitation and abrasion by suspended sediment. The nacelle can yaw through 180 degrees so that the "
    "rotor faces the current on both the flood and the ebb tide; an earlier fixed-pitch prototype that "
    "relied on symmetric blades lost about nine percent of its annual output and was abandoned in 2017. "
    "Power electronics in each nacelle convert the variable frequency output to direct current at 1,500 "
    "volts, which is carried ashore through a shared export cable.",

    "4. Foundations and installation\n"
    "The turbines stand on triangular steel frames ballasted with 260 tonnes of iron ore concrete. The "
    "frames were lowered by the heavy-lift vessel Storm Petrel during slack water, when the current falls "
    "below half a metre per second for roughly forty minutes. Divers were not used below twenty metres; "
    "instead a remotely operated vehicle connected the wet-mate electrical connectors and inspected every "
    "frame for level and scour. Installation of the fourteen frames took nineteen working days spread "
    "over two summers, and weather delays accounted for eleven of the lost days. One frame was set down "
    "on a ledge that had not appeared in the bathymetric survey and had to be lifted and repositioned "
    "three metres to the north.",

    "5. Grid connection\n"
    "A single 33 kilovolt export cable, 6.8 kilometres long, runs from a subsea hub to an onshore "
    "substation at Quarry Lane. The cable route avoids a protected eelgrass meadow by following the old "
    "harbour breakwater for two kilometres. The substation contains the inverters, a 20 megawatt hour "
    "lithium iron phosphate battery that smooths the output across slack water, and the protection relays "
    "required by the regional network operator. Because tidal output is predictable years in advance, the "
    "operator accepts day-ahead schedules from the array with a tolerance of only four percent, much "
    "tighter than the fifteen percent it allows for wind farms.",

    "6. Operating experience\n"
    "Availability averaged 92.4 percent over the first eighteen months, against a target of 95 percent. "
    "Almost all of the shortfall came from two faults in the inter-array cables during storms in January "
    "and February 2022, when rocks moved by the swell abraded the cable armour. Repairs had to wait for a "
    "spell of calm weather and took twenty-three days in total. The rotors themselves performed well: "
    "blade inspections after one year found erosion depths below 0.3 millimetres, a quarter of the design "
    "allowance. Marine growth on the frames was heavier than expected, with mussels and kelp adding about "
    "four tonnes to each structure, but it has not yet affected the turbines.",

    "7. Environmental monitoring\n"
    "Seals, porpoises and diving seabirds were monitored with hydrophones, underwater cameras and shore "
    "observers. Over 9,600 hours of footage, biologists recorded 212 close approaches by seals and no "
    "confirmed collisions with a rotor. Harbour porpoises appear to avoid the channel during peak flow "
    "regardless of the turbines, a pattern already seen in the baseline survey of 2016. Noise from the "
    "generators is audible to hydrophones at up to 1.4 kilometres but stays below the level at which "
    "behavioural responses are expected. The eelgrass meadow next to the cable route has grown by about "
    "six percent since installation.",

    "8. Costs\n"
    "The capital cost of the project was 96 million euros, of which the turbines accounted for 38 percent, "
    "foundations and installation for 29 percent, the grid connection for 18 percent and engineering, "
    "consenting and contingency for the remainder. Operation and maintenance cost 3.1 million euros in the "
    "first full year. The levelised cost of electricity is estimated at 178 euros per megawatt hour, about "
    "forty percent lower than the previous generation of tidal projects but still well above offshore wind. "
    "The board expects a second phase of twenty larger turbines to reach 120 euros per megawatt hour by "
    "sharing the existing export cable and substation.",

    "9. Lessons learned\n"
    "First, inter-array cables in rocky channels need heavier armour or burial in trenches cut into the "
    "rock; the cheaper surface-laid design saved 1.2 million euros but cost more than that in lost "
    "output. Second, the slack-water installation window is shorter than tidal tables predict when swell "
    "is present, so schedules should assume thirty minutes rather than forty. Third, the remotely operated "
    "vehicle proved more reliable than divers and should be used for all subsea connections. Fourth, the "
    "battery at the substation paid for itself within two years by allowing the array to bid into the "
    "evening peak instead of selling at whatever price prevailed at slack water.",

    "10. Recommendations\n"
    "The review board recommends that phase two proceed, that all new inter-array cables be trenched, that "
    "the monitoring programme continue for at least five more years, and that blade inspections move from "
    "an annual to a two-year cycle given the low erosion observed so far. It also recommends that the "
    "data set of flow measurements, turbine performance and wildlife observations be published so that "
    "other developers can compare sites on a common basis.",
]

# The fitting glossary is cut after as many terms as needed to land the document on a token count.
GLOSSARY = [
    "ebb tide", "flood tide", "slack water", "nacelle", "yaw drive", "capacity factor", "availability",
    "export cable", "wet-mate connector", "scour", "bathymetry", "gravity foundation", "levelised cost",
    "spring tide", "neap tide", "cavitation", "hydrophone", "inverter", "substation", "armour", "trench",
    "swell", "kelp", "mussel", "porpoise", "seal", "eelgrass", "ballast", "frame", "rotor", "blade",
    "laminate", "coating", "generator", "relay", "schedule", "tolerance", "battery", "phase", "cycle",
    "survey", "profiler", "turbulence", "sediment", "granite",
]


def fit_document(encode: Callable[[str], list[int]], target_tokens: int) -> tuple[str, int]:
    """The report plus a glossary cut so that `text` tokenizes to exactly target_tokens (if possible).

    The text ends in punctuation, so followed by a question that starts with a newline its tokens stay the
    same (a trailing blank line would tokenize differently).
    """
    body = "\n\n".join(DOCUMENT_SECTIONS) + "\n\nGlossary: "
    best = (body, len(encode(body)))
    for count in range(1, len(GLOSSARY) + 1):
        for ending in (".", " etc.", " and others.", ", among others."):
            text = body + ", ".join(GLOSSARY[:count]) + ending
            n = len(encode(text))
            if n == target_tokens:
                return text, n
            if best[1] < n <= target_tokens:
                best = (text, n)
    return best


def text_tokens(encode: Callable[[str], list[int]], min_tokens: int, start: int = 0) -> list[int]:
    """Token ids of the report's sections, repeated in a rotated order each round (the first round from section
    `start`), at least min_tokens of them."""
    sections: list[str] = []
    for rounds in itertools.count(start):
        shift = rounds % len(DOCUMENT_SECTIONS)
        sections.extend(DOCUMENT_SECTIONS[shift:] + DOCUMENT_SECTIONS[:shift])
        ids = encode("\n\n".join(sections))
        if len(ids) >= min_tokens:
            return ids
    raise AssertionError("unreachable")


QUESTIONS = [
    "\n\nWhich company supplied the turbine blades? Answer:",
    "\n\nHow many turbines make up the array? Answer:",
    "\n\nWho chaired the review board? Answer:",
    "\n\nIn which month and year did construction begin? Answer:",
]

CHAT_SYSTEM = (
    "You are a patient tutor who explains physics and engineering to adult learners. Answer in short, "
    "plain sentences, use everyday examples, avoid formulas unless the learner asks for them, and check "
    "that each answer builds on what was said earlier in the conversation. If a question is unclear, say "
    "what you assume before answering. Keep a friendly tone and never invent numbers you are not sure of."
)
CHAT_TURNS = [
    "What causes the tides in the ocean?",
    "Why are there two high tides a day instead of one?",
    "How can a turbine make electricity from a tidal current?",
    "Is tidal power more predictable than wind power? Why?",
    "What problems do engineers face when they put machines on the seabed?",
    "Summarise our conversation in two sentences.",
]

# Prompts that share no prefix with the report or with each other: each starts from its own opener word
# (distinct first tokens) and goes on with the report's sections in another order.
UNRELATED_OPENERS = ["Zebras", "Quietly", "Yesterday", "Pottery", "Every", "Marble", "Nobody", "Under"]

# Speculative decoding's prompts (llm_bench's spec_decode workload and experiments/spec/spec_decode.py): answers that
# copy the report word for word, a summary in its own wording, and chat that has nothing in its prompt to copy (what
# speculation costs when it cannot help). Each is a user message of the chat template; the document ones start with the
# report, cut to a token count with fit_document.
SPEC_QUOTE_QUESTIONS = [
    "Copy, word for word, the paragraph of the report that describes the turbine blades.",
    "Quote exactly the sentences of the report about the review board.",
]
SPEC_SUMMARY = "Summarise the report above in about a hundred words, reusing its own wording."
SPEC_UNRELATED = ["Write a short poem about a cat who learns to swim.", "Give three tips for baking bread at home."]
# kind → what its prompts are (the keys are llm_bench's request roles)
SPEC_KINDS = {
    "spec_quote": "document quotes",
    "spec_summary": "document summary",
    "spec_chat": "unrelated chat",
}


def spec_messages(document: str) -> dict[str, list[str]]:
    """kind (SPEC_KINDS) → the user messages of its prompts, the document ones quoting `document`."""
    return {"spec_quote": [f"{document}\n\n{q}" for q in SPEC_QUOTE_QUESTIONS],
            "spec_summary": [f"{document}\n\n{SPEC_SUMMARY}"],
            "spec_chat": list(SPEC_UNRELATED)}
